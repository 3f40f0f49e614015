// Stream a chat answer from kvgrid: node examples/generate.mjs "What is the capital of France?"
// The server address comes from KVGRID_ADDR (default localhost:50051); Ctrl-C cancels the request.
import { KvgridClient, KvgridError } from '@kvgrid/client';

const prompt = process.argv[2] ?? 'What is the capital of France?';
const client = new KvgridClient(); // address: $KVGRID_ADDR or localhost:50051
const controller = new AbortController();
process.once('SIGINT', () => controller.abort());

try {
  const messages = [{ role: 'user', content: prompt }];
  for await (const delta of client.chat(messages, { maxTokens: 64, signal: controller.signal })) {
    process.stdout.write(delta.text);
    if (delta.finishReason) console.log(`\n[${delta.finishReason}] ${delta.usage.completionTokens} tokens`);
  }
} catch (err) {
  if (err.name === 'AbortError') {
    console.error('\ncancelled');
    process.exitCode = 130;
  } else if (err instanceof KvgridError) {
    console.error(`\n${err.codeName} (${err.code}): ${err.details}`);
    process.exitCode = 1;
  } else {
    throw err;
  }
} finally {
  client.close();
}
