// Stream a chat completion from kvgrid's OpenAI-compatible HTTP API with the official `openai` package:
//   node examples/openai.mjs "What is the capital of France?"
// The base URL comes from OPENAI_BASE_URL (default http://localhost:8000/v1, the frontend's HTTP port).
import OpenAI from 'openai';

const prompt = process.argv[2] ?? 'What is the capital of France?';
const client = new OpenAI({
  baseURL: process.env.OPENAI_BASE_URL ?? 'http://localhost:8000/v1',
  apiKey: process.env.OPENAI_API_KEY ?? 'unused', // the client insists on one; kvgrid does not check it
});

const { data: models } = await client.models.list();
const stream = await client.chat.completions.create({
  model: models[0].id,
  messages: [{ role: 'user', content: prompt }],
  max_tokens: 64,
  temperature: 0,
  stream: true,
  stream_options: { include_usage: true },
});
for await (const chunk of stream) {
  const choice = chunk.choices[0];
  if (choice?.delta?.content) process.stdout.write(choice.delta.content);
  if (choice?.finish_reason) process.stdout.write(`\n[${choice.finish_reason}]`);
  if (chunk.usage) console.log(` ${chunk.usage.completion_tokens} tokens`);
}
