// The package against an in-process fake server: request mapping, deltas, errors, cancellation.
import assert from 'node:assert/strict';
import { after, before, test as nodeTest } from 'node:test';

import { API_KEY_ENV, KvgridClient, KvgridError, PROTO_DIR_ENV, resolveProtoDir } from '../src/index.js';
import { REPLY, startFakeServer, waitFor } from './fake-server.mjs';

// A broken cancellation would leave a call streaming forever: each test gets a time limit.
const test = (name, fn) => nodeTest(name, { timeout: 20_000 }, fn);

let server;
let client;
before(async () => {
  server = await startFakeServer();
  client = new KvgridClient({ address: server.address });
});
after(() => {
  client.close();
  server.stop();
});

async function collect(iterable) {
  const out = [];
  for await (const delta of iterable) out.push(delta);
  return out;
}

test('generate sends the prompt and camelCase sampling options as SamplingParams', async () => {
  const options = { maxTokens: 3, temperature: 0.5, topK: 7, seed: 11, stop: ['END'], ignoreEos: true };
  await collect(client.generate('Once upon', { ...options, requestId: 'r1' }));
  const request = server.requests.at(-1);
  assert.equal(request.prompt, 'Once upon');
  assert.equal(request.requestId, 'r1');
  const { maxTokens, temperature, topK, seed, stop, ignoreEos } = request.sampling;
  assert.deepEqual({ maxTokens, temperature, topK, seed, stop, ignoreEos }, options);
});

test('a prompt given as token ids goes in prompt_token_ids', async () => {
  await collect(client.generate([5, 6, 7]));
  const request = server.requests.at(-1);
  assert.deepEqual([request.prompt, request.promptTokenIds], ['', [5, 6, 7]]);
});

test('deltas carry text and ids; only the last has finishReason and usage', async () => {
  const deltas = await collect(client.chat([{ role: 'user', content: 'hi' }]));
  assert.deepEqual(
    server.requests.at(-1).messages.map(({ role, content }) => ({ role, content })),
    [{ role: 'user', content: 'hi' }],
  );
  assert.deepEqual(
    deltas.map((d) => d.text),
    REPLY,
  );
  assert.deepEqual(
    deltas.map((d) => d.tokenIds),
    [[300], [301], [302]],
  );
  assert.deepEqual(
    deltas.map((d) => d.finishReason),
    [null, null, 'length'],
  );
  assert.equal(deltas[0].usage, null);
  assert.deepEqual(deltas.at(-1).usage, { promptTokens: 4, completionTokens: 3, cachedPromptTokens: 0 });
});

test('an unknown option is a TypeError that lists the accepted ones', () => {
  assert.throws(() => client.generate('x', { max_tokens: 3 }), {
    name: 'TypeError',
    message: /unknown option "max_tokens" \(options: maxTokens, temperature, .*signal, timeoutMs, requestId\)/,
  });
});

test('a server error is a KvgridError with the status code, its name and the details', async () => {
  const err = await collect(client.generate('bad')).catch((e) => e);
  assert.ok(err instanceof KvgridError && err instanceof Error);
  assert.deepEqual([err.code, err.codeName, err.details], [3, 'INVALID_ARGUMENT', 'sampling.top_p: must be in [0, 1]']);
  assert.equal(err.message, 'INVALID_ARGUMENT: sampling.top_p: must be in [0, 1]');
});

test('an unreachable server is UNAVAILABLE', async () => {
  const closed = new KvgridClient({ address: '127.0.0.1:1' });
  const err = await closed.getModelInfo({ timeoutMs: 10_000 }).catch((e) => e);
  closed.close();
  assert.ok(err instanceof KvgridError);
  assert.deepEqual([err.code, err.codeName], [14, 'UNAVAILABLE']);
});

test('a signal aborted before the call starts nothing and throws its reason', async () => {
  const before = server.requests.length;
  const err = await collect(client.generate('x', { signal: AbortSignal.abort() })).catch((e) => e);
  assert.equal(err.name, 'AbortError');
  assert.equal(server.requests.length, before);
});

test('aborting mid-stream cancels the call on the server and throws AbortError', async () => {
  const controller = new AbortController();
  const received = [];
  const err = await (async () => {
    for await (const delta of client.generate('slow', { signal: controller.signal })) {
      received.push(delta);
      if (received.length === 2) controller.abort();
    }
  })().catch((e) => e);
  assert.equal(err?.name, 'AbortError');
  assert.equal(received.length, 2);
  await waitFor(() => server.cancelled.includes(server.requests.at(-1)));
});

test('leaving the loop early cancels the call on the server', async () => {
  for await (const delta of client.generate('slow')) {
    assert.equal(delta.text, 'x');
    break;
  }
  await waitFor(() => server.cancelled.includes(server.requests.at(-1)));
});

test('unary calls return plain objects', async () => {
  const info = await client.getModelInfo();
  assert.deepEqual([info.model, info.vocabSize], ['fake', 1000]);
});

test('the proto directory comes from the option or KVGRID_PROTO_DIR, with a clear error when absent', () => {
  assert.match(resolveProtoDir(), /protos$/);
  assert.throws(() => resolveProtoDir('/nonexistent'), /kvgrid protos not found: .*KVGRID_PROTO_DIR/);
  process.env[PROTO_DIR_ENV] = '/also-missing';
  try {
    assert.throws(() => new KvgridClient(), /\/also-missing\/kvgrid\/v1\/generate.proto does not exist/);
  } finally {
    delete process.env[PROTO_DIR_ENV];
  }
});

test('an API key (option, else KVGRID_API_KEY) goes on every call as a bearer token; none without one', async () => {
  const keyed = new KvgridClient({ address: server.address, apiKey: 'k-option' });
  await collect(keyed.generate('x'));
  await keyed.getModelInfo();
  keyed.close();
  assert.deepEqual(server.authorizations.slice(-2), [['Bearer k-option'], ['Bearer k-option']]);
  process.env[API_KEY_ENV] = 'k-env';
  try {
    const fromEnv = new KvgridClient({ address: server.address });
    await collect(fromEnv.chat([{ role: 'user', content: 'hi' }]));
    fromEnv.close();
  } finally {
    delete process.env[API_KEY_ENV];
  }
  assert.deepEqual(server.authorizations.at(-1), ['Bearer k-env']);
  await collect(client.generate('x'));
  assert.deepEqual(server.authorizations.at(-1), []);
});

test('chat sends tools, toolChoice and parallelToolCalls as the proto fields', async () => {
  const parameters = { type: 'object', properties: { a: { type: 'integer' } } };
  const tools = [{ type: 'function', function: { name: 'add', description: 'Add', parameters } }];
  const call = { id: 'call_1', type: 'function', function: { name: 'add', arguments: '{"a": 1}' } };
  const messages = [
    { role: 'user', content: 'hi' },
    { role: 'assistant', content: '', toolCalls: [call] },
    { role: 'tool', content: '2', toolCallId: 'call_1' },
  ];
  const choice = { type: 'function', function: { name: 'add' } };
  await collect(client.chat(messages, { tools, toolChoice: choice, parallelToolCalls: false, maxTokens: 3 }));
  const request = server.requests.at(-1);
  assert.deepEqual(request.tools, [
    { type: 'function', function: { name: 'add', description: 'Add', parameters: JSON.stringify(parameters) } },
  ]);
  assert.deepEqual(request.toolChoice, { mode: 'function', functionName: 'add' });
  assert.equal(request.parallelToolCalls, false);
  assert.deepEqual(request.messages[1].toolCalls, [call]);
  assert.equal(request.messages[2].toolCallId, 'call_1');
  assert.equal(request.sampling.maxTokens, 3);
});
