// ShardClient: a storage shard's wire API (chunked Arrow IPC streams), as shard_client.py speaks it.
import { once } from 'node:events';

import { Status, TQError } from './errors.js';
import { callMetadata, deadline, makeClient, unary } from './rpc.js';

// Sluice's own sender and the shard use 4 MiB chunks.
export const CHUNK_BYTES = 4 << 20;
const DEFAULT_TIMEOUT_S = 120;

export class ShardClient {
  constructor(StorageShard, address, { token, chunkBytes = CHUNK_BYTES } = {}) {
    this.address = address;
    this.token = token;
    this.chunkBytes = chunkBytes;
    this.client = makeClient(StorageShard, address);
  }

  // Put: the header with the first chunk, then data-only chunks; all rows are stored or none.
  // reservation: PreparePut's reservation for these rows (shards refuse puts without one).
  async put(partition, rows, ipc, { timeoutS = DEFAULT_TIMEOUT_S, reservation = Buffer.alloc(0) } = {}) {
    const data = Buffer.from(ipc.buffer, ipc.byteOffset, ipc.byteLength);
    let call;
    const done = new Promise((resolve, reject) => {
      call = this.client.Put(callMetadata(this.token), { deadline: deadline(timeoutS) }, (err, res) => {
        if (err) reject(TQError.fromGrpc(err));
        else resolve(res);
      });
    });
    const header = { partition, rows, total_bytes: data.length, reservation };
    for (let start = 0; start === 0 || start < data.length; start += this.chunkBytes) {
      const chunk = data.subarray(start, start + this.chunkBytes);
      const message = start === 0 ? { header, data: chunk } : { data: chunk };
      if (!call.write(message)) await Promise.race([once(call, 'drain'), done]);
    }
    call.end();
    return done;
  }

  // Get: the Arrow IPC stream of the rows (in request order) and fields, reassembled from chunks.
  async get(partition, rows, fields, { timeoutS = DEFAULT_TIMEOUT_S } = {}) {
    const options = { deadline: deadline(timeoutS) };
    const call = this.client.Get({ partition, rows, fields }, callMetadata(this.token), options);
    let buf = null;
    let pos = 0;
    try {
      for await (const chunk of call) {
        if (buf === null) buf = Buffer.allocUnsafe(chunk.total_bytes);
        if (pos + chunk.data.length > buf.length) {
          call.cancel();
          throw new TQError(Status.DATA_LOSS, 'shard sent more bytes than it announced');
        }
        chunk.data.copy(buf, pos);
        pos += chunk.data.length;
      }
    } catch (err) {
      throw TQError.fromGrpc(err);
    }
    if (buf === null || pos !== buf.length) throw new TQError(Status.DATA_LOSS, 'shard stream ended early');
    return buf;
  }

  delete(partition, rows, fields, { timeoutS = 5 } = {}) {
    return unary(this.client, 'Delete', { partition, rows, fields }, { token: this.token, timeoutS });
  }

  stats({ timeoutS = 30 } = {}) {
    return unary(this.client, 'Stats', {}, { token: this.token, timeoutS });
  }

  close() {
    this.client.close();
  }
}
