// The package against a real `kvgrid serve` stack (tests/clients/test_node_client.py starts one).
// KVGRID_TEST_ADDR / KVGRID_TEST_SCHEDULER_ADDR: the frontend and the scheduler; KVGRID_TEST_EXPECTED:
// a JSON file with requests and the Python client's answers to them.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, describe, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { KvgridClient, KvgridError, loadProtos } from '../src/index.js';

const { KVGRID_TEST_ADDR: addr, KVGRID_TEST_SCHEDULER_ADDR: schedulerAddr, KVGRID_TEST_EXPECTED } = process.env;
const skip = addr && schedulerAddr && KVGRID_TEST_EXPECTED ? false : 'KVGRID_TEST_ADDR etc. not set (no kvgrid stack)';

async function collect(iterable) {
  const deltas = [];
  for await (const delta of iterable) deltas.push(delta);
  return { text: deltas.map((d) => d.text).join(''), tokenIds: deltas.flatMap((d) => d.tokenIds), last: deltas.at(-1) };
}

describe('against a kvgrid stack', { skip, timeout: 240_000 }, () => {
  const expected = skip ? {} : JSON.parse(readFileSync(KVGRID_TEST_EXPECTED, 'utf8'));
  const client = skip ? null : new KvgridClient({ address: addr });
  const scheduler = skip ? null : new (loadProtos().v1.Scheduler)(schedulerAddr, grpc.credentials.createInsecure());
  after(() => {
    client?.close();
    scheduler?.close();
  });

  const stats = () =>
    new Promise((resolve, reject) => scheduler.GetStats({}, (err, s) => (err ? reject(err) : resolve(s))));

  async function waitIdle(timeoutMs = 60_000) {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const s = await stats();
      if ((s.numRunning === 0 && s.numWaiting === 0 && s.numBlocksUsed === 0) || Date.now() > deadline) return s;
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }

  test('a greedy Generate equals the Python client output for the same request', async () => {
    const { request, text, tokenIds, finishReason, usage } = expected.generate;
    const got = await collect(client.generate(request.prompt, request.sampling));
    assert.deepEqual(got.tokenIds, tokenIds);
    assert.equal(got.text, text);
    assert.equal(got.last.finishReason, finishReason);
    const { promptTokens, completionTokens } = got.last.usage; // cachedPromptTokens differs: the prefix cache
    assert.deepEqual({ promptTokens, completionTokens }, usage);
  });

  test('a Chat equals the Python client output for the same conversation', async () => {
    const { request, text, tokenIds, finishReason } = expected.chat;
    const got = await collect(client.chat(request.messages, request.sampling));
    assert.deepEqual(got.tokenIds, tokenIds);
    assert.equal(got.text, text);
    assert.equal(got.last.finishReason, finishReason);
    assert.equal(got.last.usage.completionTokens, tokenIds.length);
  });

  test('aborting a stream cancels the request and frees its blocks', async () => {
    const controller = new AbortController();
    const stream = client.generate('Count slowly: one, two,', { maxTokens: 400, ignoreEos: true, signal: controller.signal });
    let received = 0;
    const err = await (async () => {
      for await (const delta of stream) {
        received += delta.tokenIds.length;
        if (received >= 3 && !controller.signal.aborted) {
          const running = await stats();
          assert.equal(running.numRunning, 1);
          assert.ok(running.numBlocksUsed > 0, 'a running request holds blocks');
          controller.abort();
        }
      }
    })().catch((e) => e);
    assert.equal(err?.name, 'AbortError');
    const s = await waitIdle();
    assert.deepEqual([s.numRunning, s.numWaiting, s.numBlocksUsed], [0, 0, 0]);
  });

  test('leaving the loop early frees the blocks too', async () => {
    let received = 0;
    for await (const delta of client.generate('Count slowly: one, two,', { maxTokens: 400, ignoreEos: true })) {
      received += delta.tokenIds.length;
      if (received >= 3) break;
    }
    const s = await waitIdle();
    assert.deepEqual([s.numRunning, s.numWaiting, s.numBlocksUsed], [0, 0, 0]);
  });

  test('bad input is INVALID_ARGUMENT with the field named', async () => {
    const err = await collect(client.generate('Hello', { topP: 1.5 })).catch((e) => e);
    assert.ok(err instanceof KvgridError, String(err));
    assert.deepEqual([err.code, err.codeName], [grpc.status.INVALID_ARGUMENT, 'INVALID_ARGUMENT']);
    assert.match(err.details, /^sampling\.top_p: /);
    const chatErr = await collect(client.chat([{ role: 'wizard', content: 'hi' }])).catch((e) => e);
    assert.deepEqual([chatErr.codeName, chatErr.details.split(':')[0]], ['INVALID_ARGUMENT', 'messages[0].role']);
  });

  test('tokenize, detokenize and getModelInfo', async () => {
    const info = await client.getModelInfo();
    assert.deepEqual([info.model, info.vocabSize], [expected.modelInfo.model, expected.modelInfo.vocabSize]);
    const { tokenIds, tokens } = await client.tokenize('The capital of France');
    assert.equal(tokens.length, tokenIds.length);
    assert.equal(await client.detokenize(tokenIds), 'The capital of France');
  });
});
