// The gRPC services, loaded at runtime from the repository's proto/ with @grpc/proto-loader
// (grpc-js's dynamic code generation): message shapes come from the .proto, not from this code.
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const HERE = path.dirname(fileURLToPath(import.meta.url));
// services/transferqueue/client/node/src -> the repository root's proto/
export const DEFAULT_PROTO_DIR = path.resolve(HERE, '..', '..', '..', '..', '..', 'proto');
export const PROTO_FILE = 'sluice/transferqueue/v1/transferqueue.proto';

// Field names as in the .proto (snake_case); int64 as JavaScript numbers (row indices and
// millisecond timestamps stay far below 2^53); enums by name; absent fields as their defaults.
const LOADER_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };

const cache = new Map();

// -> {Controller, StorageShard}: grpc-js client constructors of package sluice.transferqueue.v1.
export function loadServices(protoDir = process.env.SLUICE_PROTO_DIR || DEFAULT_PROTO_DIR) {
  if (!cache.has(protoDir)) {
    const definition = protoLoader.loadSync(PROTO_FILE, { ...LOADER_OPTIONS, includeDirs: [protoDir] });
    const pkg = grpc.loadPackageDefinition(definition).sluice.transferqueue.v1;
    cache.set(protoDir, { Controller: pkg.Controller, StorageShard: pkg.StorageShard });
  }
  return cache.get(protoDir);
}
