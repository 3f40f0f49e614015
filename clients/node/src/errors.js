// A failed call as one error type: the gRPC status code (number and name) and the server's message.
import { status } from '@grpc/grpc-js';

const STATUS_NAMES = Object.fromEntries(
  Object.entries(status)
    .filter(([, value]) => typeof value === 'number')
    .map(([name, value]) => [value, name]),
);

export class KvgridError extends Error {
  /**
   * @param {number} code gRPC status code, e.g. 3
   * @param {string} details the server's message, e.g. "sampling.top_p: must be in [0, 1], got 1.5"
   * @param {import('@grpc/grpc-js').Metadata | undefined} metadata trailing metadata, when any
   */
  constructor(code, details, metadata = undefined, options = undefined) {
    const codeName = STATUS_NAMES[code] ?? `STATUS_${code}`;
    super(`${codeName}: ${details}`, options);
    this.name = 'KvgridError';
    this.code = code;
    this.codeName = codeName;
    this.details = details;
    this.metadata = metadata;
  }

  /** Wraps a grpc-js ServiceError (anything with a numeric `code`); other errors are returned unchanged. */
  static from(err) {
    if (err instanceof KvgridError || typeof err?.code !== 'number') return err;
    return new KvgridError(err.code, err.details ?? err.message, err.metadata, { cause: err });
  }
}

export { status as Status };
