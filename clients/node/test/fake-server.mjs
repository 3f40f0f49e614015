// An in-process TextGeneration server for the package's own tests: records requests, streams scripted replies.
import * as grpc from '@grpc/grpc-js';

import { loadProtos } from '../src/index.js';

export const REPLY = ['Hel', 'lo', ' wörld'];

/** Streams REPLY (prompt "slow": one piece every 50 ms, forever); prompt "bad" is INVALID_ARGUMENT. */
export async function startFakeServer() {
  const { v1 } = loadProtos();
  const requests = [];
  const authorizations = []; // the authorization metadata of each call, in order ([] when none was sent)
  const cancelled = [];
  const stream = (call) => {
    requests.push(call.request);
    authorizations.push(call.metadata.get('authorization'));
    call.on('cancelled', () => cancelled.push(call.request));
    if (call.request.prompt === 'bad') {
      call.emit('error', { code: grpc.status.INVALID_ARGUMENT, details: 'sampling.top_p: must be in [0, 1]' });
      return;
    }
    if (call.request.prompt === 'slow') {
      const timer = setInterval(() => call.write({ text: 'x', tokenIds: [1] }), 50);
      call.on('cancelled', () => clearInterval(timer));
      return;
    }
    REPLY.forEach((text, i) => {
      const last = i === REPLY.length - 1;
      call.write({
        text,
        tokenIds: [300 + i],
        finishReason: last ? 'length' : '',
        usage: last ? { promptTokens: 4, completionTokens: REPLY.length } : null,
      });
    });
    call.end();
  };
  const server = new grpc.Server();
  server.addService(v1.TextGeneration.service, {
    Generate: stream,
    Chat: stream,
    GetModelInfo: (call, callback) => {
      authorizations.push(call.metadata.get('authorization'));
      callback(null, { model: 'fake', vocabSize: 1000 });
    },
  });
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  return { address: `127.0.0.1:${port}`, requests, authorizations, cancelled, stop: () => server.forceShutdown() };
}

export async function waitFor(predicate, timeoutMs = 10_000) {
  const deadline = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`condition not met in ${timeoutMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}
