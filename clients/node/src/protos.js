// Loads kvgrid's .proto files at run time, so the package needs no generated code.
import { existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

export const PROTO_DIR_ENV = 'KVGRID_PROTO_DIR';
const ENTRY_FILES = ['kvgrid/v1/generate.proto', 'kvgrid/v1/scheduler.proto'];
const HERE = dirname(fileURLToPath(import.meta.url));
// In the kvgrid repository the package sits at clients/node, two levels below protos/.
const REPO_PROTO_DIR = resolve(HERE, '..', '..', '..', 'protos');

const LOADER_OPTIONS = {
  keepCase: false, // fields as camelCase: maxTokens, tokenIds, finishReason
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
};

const cache = new Map();

/** The directory holding kvgrid/v1/*.proto: the option, else $KVGRID_PROTO_DIR, else the repository's protos/. */
export function resolveProtoDir(protoDir) {
  const dir = resolve(protoDir ?? process.env[PROTO_DIR_ENV] ?? REPO_PROTO_DIR);
  if (!existsSync(join(dir, ENTRY_FILES[0]))) {
    throw new Error(
      `kvgrid protos not found: ${join(dir, ENTRY_FILES[0])} does not exist ` +
        `(pass {protoDir} or set ${PROTO_DIR_ENV} to the directory that holds kvgrid/v1/*.proto)`,
    );
  }
  return dir;
}

/**
 * The `kvgrid.v1` gRPC package (service constructors: TextGeneration, Scheduler, ...) and the
 * names of SamplingParams' fields, loaded once per proto directory.
 */
export function loadProtos(protoDir) {
  const dir = resolveProtoDir(protoDir);
  if (!cache.has(dir)) {
    const definition = protoLoader.loadSync(ENTRY_FILES, { ...LOADER_OPTIONS, includeDirs: [dir] });
    const samplingFields = definition['kvgrid.v1.SamplingParams'].type.field.map((f) => f.name);
    cache.set(dir, { v1: grpc.loadPackageDefinition(definition).kvgrid.v1, samplingFields, protoDir: dir });
  }
  return cache.get(dir);
}
