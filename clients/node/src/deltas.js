// Streamed GenerateResponse messages as plain deltas, with cancellation through an AbortSignal.
import { KvgridError } from './errors.js';

/** One streamed message: what was added since the previous one; the last has finishReason and usage. */
export function toDelta(message) {
  return {
    text: message.text,
    tokenIds: message.tokenIds,
    finishReason: message.finishReason || null,
    usage: message.usage ?? null,
    logprobs: message.logprobs,
    requestId: message.requestId,
    toolCalls: message.toolCalls ?? [],
  };
}

function abortReason(signal) {
  return signal.reason ?? new DOMException('This operation was aborted', 'AbortError');
}

/**
 * Iterates a server-streaming call as deltas. Aborting `signal` cancels the call and the iterator
 * throws the signal's reason (an AbortError by default); leaving the loop early cancels the call too.
 * Server errors are thrown as KvgridError.
 */
export async function* deltas(startCall, signal) {
  signal?.throwIfAborted();
  const call = startCall();
  const cancel = () => call.cancel();
  signal?.addEventListener('abort', cancel, { once: true });
  try {
    for await (const message of call) {
      yield toDelta(message);
    }
  } catch (err) {
    if (signal?.aborted) throw abortReason(signal);
    throw KvgridError.from(err);
  } finally {
    signal?.removeEventListener('abort', cancel);
    call.cancel(); // a no-op once the server has ended the call
  }
}

/** A unary call as a promise; aborting `signal` cancels it and rejects with the signal's reason. */
export function unary(client, method, request, metadata, callOptions, signal) {
  if (signal?.aborted) return Promise.reject(abortReason(signal));
  return new Promise((resolvePromise, reject) => {
    let call;
    const cancel = () => call.cancel();
    call = client[method](request, metadata, callOptions, (err, response) => {
      signal?.removeEventListener('abort', cancel);
      if (signal?.aborted) reject(abortReason(signal));
      else if (err) reject(KvgridError.from(err));
      else resolvePromise(response);
    });
    signal?.addEventListener('abort', cancel, { once: true });
  });
}
