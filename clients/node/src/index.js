// @kvgrid/client: stream completions from a kvgrid server over gRPC.
export { ADDR_ENV, API_KEY_ENV, DEFAULT_ADDR, KvgridClient } from './client.js';
export { toDelta } from './deltas.js';
export { KvgridError, Status } from './errors.js';
export { loadProtos, PROTO_DIR_ENV, resolveProtoDir } from './protos.js';
