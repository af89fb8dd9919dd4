// Sluice TransferQueue client for Node.js: see README.md.
export { TransferQueueClient, splitByShard } from './client.js';
export { ShardClient, CHUNK_BYTES } from './shard.js';
export { TQError, Status } from './errors.js';
export { encodeColumns, toIpc } from './encode.js';
export { fromIpc } from './decode.js';
export { DTYPES, DTYPE_META } from './dtypes.js';
export { loadServices, DEFAULT_PROTO_DIR } from './proto.js';
export { toPlain, batchToPlain } from './plain.js';
export { tokenFromEnv } from './token.js';
