// TransferQueueClient: the Node.js mirror of the Python AsyncTransferQueue (client/queue.py).
//
// A put: PreparePut (controller: validate schemas, allocate rows) -> Arrow IPC bytes to the shards
// that own the rows, in parallel -> CommitPut (controller: rows become readable). If a shard put
// or the commit fails, the bytes that reached shards are deleted again and the error is raised.
// A read: Claim (controller: rows + lease) or CheckRows -> bytes from the shards in parallel ->
// decoded columns in request order.
import { fromIpc, mergeInOrder } from './decode.js';
import { encodeColumns, selectRows, toIpc } from './encode.js';
import { Status, TQError, invalid } from './errors.js';
import { loadServices } from './proto.js';
import { TLS_SCHEME, makeClient, unary, withTls } from './rpc.js';
import { ShardClient } from './shard.js';
import { tokenFromEnv } from './token.js';

// slack on top of a claim's long-poll wait for the RPC deadline
const WAIT_SLACK_S = 10;
const DEFAULT_TIMEOUT_S = 30;
// a CommitPut that failed with these was certainly not applied (unlike, say, a lost reply)
const COMMIT_REFUSED = new Set([Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.FAILED_PRECONDITION,
  Status.ALREADY_EXISTS, Status.UNAUTHENTICATED, Status.PERMISSION_DENIED]);

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const leaseIdOf = (lease) => (typeof lease === 'string' ? lease : lease.leaseId);

// shard_of(row) = shard_ids[(row / placement_block) % len(shard_ids)] -> [[shard id, positions]]
export function splitByShard(info, rows) {
  const ids = info.shard_ids;
  const block = Number(info.placement_block);
  if (!ids.length || !(block > 0)) {
    throw new TQError(Status.FAILED_PRECONDITION, `partition ${info.name} has no placement`);
  }
  const plan = new Map();
  rows.forEach((row, pos) => {
    const id = ids[Math.floor(row / block) % ids.length];
    if (!plan.has(id)) plan.set(id, []);
    plan.get(id).push(pos);
  });
  return [...plan.entries()];
}

export class TransferQueueClient {
  // controller: "host:port", or "tls://host:port" for TLS (the shards are then dialled with TLS too;
  // certificates from SLUICE_TLS_CA_FILE, SLUICE_TLS_CLIENT_CERT_FILE, SLUICE_TLS_CLIENT_KEY_FILE).
  // options: token (bearer; default: SLUICE_AUTH_TOKEN_FILE's content, else SLUICE_AUTH_TOKEN, as the
  // services read it), protoDir (default: the repository's proto/),
  // putTimeoutS (how long a put retries a full shard), chunkBytes (shard stream chunk size).
  constructor(controller, { token = tokenFromEnv(), protoDir, putTimeoutS = 60, chunkBytes } = {}) {
    this.services = loadServices(protoDir);
    this.token = token;
    this.putTimeoutS = putTimeoutS;
    this.chunkBytes = chunkBytes;
    this.controller = makeClient(this.services.Controller, controller);
    this.tls = controller.startsWith(TLS_SCHEME);
    this.shardAddresses = new Map();
    this.shards = new Map();
    this.placements = new Map();
    this.taskFields = new Map();
  }

  close() {
    this.controller.close();
    for (const shard of this.shards.values()) shard.close();
    this.shards.clear();
  }

  call(method, request, timeoutS = DEFAULT_TIMEOUT_S) {
    return unary(this.controller, method, request, { token: this.token, timeoutS });
  }

  // ------------------------------------------------------------ admin

  createPartition(name, { groupSize = 1, existOk = false, placementBlock = 0 } = {}) {
    const request = { name, group_size: groupSize, exist_ok: existOk, placement_block: placementBlock };
    return this.call('CreatePartition', request);
  }

  getPartition(name) {
    return this.call('GetPartition', { name });
  }

  async listPartitions(prefix = '') {
    return (await this.call('ListPartitions', { prefix })).partitions;
  }

  sealPartition(name) {
    return this.call('SealPartition', { name });
  }

  async clearPartition(name) {
    this.placements.delete(name);
    return (await this.call('ClearPartition', { name })).existed;
  }

  async registerTask(name, requiredFields, { groupSize = 1 } = {}) {
    const info = await this.call('RegisterTask', { name, required_fields: requiredFields, group_size: groupSize });
    this.taskFields.set(name, [...requiredFields]);
    return info;
  }

  async listTasks() {
    return (await this.call('ListTasks', {})).tasks;
  }

  async schema(partition) {
    return (await this.call('GetSchema', { partition })).fields;
  }

  // ------------------------------------------------------------ placement and shards

  async placement(partition, info) {
    if (info) this.placements.set(partition, info);
    else if (!this.placements.has(partition)) this.placements.set(partition, await this.getPartition(partition));
    const placement = this.placements.get(partition);
    if (placement.shard_ids.some((id) => !this.shardAddresses.has(id))) {
      for (const s of (await this.call('ListShards', {})).shards) {
        if (this.shardAddresses.get(s.shard_id) !== s.address) {
          this.shardAddresses.set(s.shard_id, s.address);
          this.shards.get(s.shard_id)?.close();
          this.shards.delete(s.shard_id);
        }
      }
    }
    return placement;
  }

  shard(shardId) {
    if (!this.shards.has(shardId)) {
      const address = this.shardAddresses.get(shardId);
      if (!address) throw new TQError(Status.UNAVAILABLE, `storage shard ${shardId} is not registered`);
      const options = { token: this.token, ...(this.chunkBytes ? { chunkBytes: this.chunkBytes } : {}) };
      this.shards.set(shardId, new ShardClient(this.services.StorageShard, withTls(address, this.tls), options));
    }
    return this.shards.get(shardId);
  }

  // ------------------------------------------------------------ put

  // Store columns as new rows (or as fields of existing `rows`); resolves to the row indices. The
  // rows are readable when it resolves, and not before.
  async put(partition, columns, { rows } = {}) {
    const { n, schemas, columns: cols } = encodeColumns(columns);
    if (rows !== undefined && rows.length !== n) throw invalid(`${rows.length} rows named for ${n} rows of data`);
    const prepared = await this.call('PreparePut', {
      partition, fields: schemas, new_rows: rows === undefined ? n : 0, rows: rows ?? [],
    });
    const allocated = prepared.rows.map(Number);
    const plan = splitByShard(await this.placement(partition, prepared.partition), allocated);
    const fields = schemas.map((s) => s.name);
    const stored = [];
    const send = async ([shardId, positions]) => {
      const ipc = toIpc(cols.map((c) => selectRows(c, positions)));
      await this.putRetrying(shardId, partition, positions.map((p) => allocated[p]), ipc, prepared.reservation);
      stored.push([shardId, positions]);
    };
    const sent = await Promise.allSettled(plan.map(send));
    const failed = sent.find((r) => r.status === 'rejected');
    if (failed) {
      await this.undo(partition, stored, allocated, fields);
      throw failed.reason;
    }
    try {
      await this.call('CommitPut', { partition, fields: schemas, rows: allocated });
    } catch (err) {
      if (COMMIT_REFUSED.has(err.code)) await this.undo(partition, stored, allocated, fields);
      throw err;
    }
    return allocated;
  }

  // A full shard (RESOURCE_EXHAUSTED) is retried with jittered exponential backoff up to putTimeoutS.
  async putRetrying(shardId, partition, rows, ipc, reservation) {
    const deadlineMs = Date.now() + this.putTimeoutS * 1000;
    let delayMs = 20;
    for (;;) {
      try {
        return await this.shard(shardId).put(partition, rows, ipc, { reservation });
      } catch (err) {
        // only a full shard frees up; a put over a per-call cap never fits
        const full = err.code === Status.RESOURCE_EXHAUSTED && String(err.details ?? err.message).includes('shard full');
        if (!full || Date.now() + delayMs > deadlineMs) throw err;
        await sleep(delayMs * (0.5 + Math.random()));
        delayMs = Math.min(delayMs * 2, 1000);
      }
    }
  }

  async undo(partition, stored, rows, fields) {
    for (const [shardId, positions] of stored) {
      try {
        await this.shard(shardId).delete(partition, positions.map((p) => rows[p]), fields);
      } catch {
        // unreadable anyway: never committed
      }
    }
  }

  // ------------------------------------------------------------ read

  async fetch(partition, rows, fields, leaseId = '') {
    const placement = await this.placement(partition);
    const parts = await Promise.all(splitByShard(placement, rows).map(async ([shardId, positions]) => {
      const ipc = await this.shard(shardId).get(partition, positions.map((p) => rows[p]), fields);
      return { positions, decoded: fromIpc(ipc) };
    }));
    const { columns, schema } = mergeInOrder(parts, rows.length);
    return { partition, rows, columns, schema, leaseId, complete: false };
  }

  // Read fields of rows (no claim). Every row must have every field, else NOT_FOUND.
  async get(partition, rows, fields) {
    const checked = await this.call('CheckRows', { partition, rows, fields });
    await this.placement(partition, checked.partition);
    return this.fetch(partition, [...rows].map(Number), [...fields]);
  }

  async fieldsOf(task) {
    if (!this.taskFields.has(task)) {
      for (const t of await this.listTasks()) this.taskFields.set(t.name, t.required_fields);
    }
    if (!this.taskFields.has(task)) throw new TQError(Status.NOT_FOUND, `task ${task} is not registered`);
    return this.taskFields.get(task);
  }

  // Claim rows without reading them.
  async claimRows(partition, task, batchSize, { waitS = 0, leaseS = 0, minRows = 0, claimKey = '' } = {}) {
    const res = await this.call('Claim', {
      partition, task, batch_size: batchSize, wait_ms: Math.round(waitS * 1000),
      lease_ms: Math.round(leaseS * 1000), min_rows: minRows, claim_key: claimKey,
    }, waitS + WAIT_SLACK_S);
    return {
      partition, task, leaseId: res.lease_id, rows: res.rows.map(Number), complete: res.partition_complete,
      groupSize: res.group_size, leaseExpiresUnixMs: res.lease_expires_unix_ms,
    };
  }

  // Claim up to batchSize ready rows (whole groups) and read `fields` (default: the task's required
  // fields). No rows means nothing was ready by the deadline; `complete` says the partition is
  // sealed and fully consumed by this task.
  async claim(partition, task, batchSize, { fields, ...options } = {}) {
    const claimed = await this.claimRows(partition, task, batchSize, options);
    if (!claimed.rows.length) {
      return { partition, rows: [], columns: {}, schema: {}, leaseId: '', complete: claimed.complete };
    }
    try {
      const batch = await this.fetch(partition, claimed.rows, fields ?? await this.fieldsOf(task), claimed.leaseId);
      batch.complete = claimed.complete;
      return batch;
    } catch (err) {
      await this.release(claimed.leaseId).catch(() => {});
      throw err;
    }
  }

  // lease: a lease id or a batch from claim(); rows: a subset (whole groups), default all.
  async ack(lease, rows = []) {
    return (await this.call('Ack', { lease_id: leaseIdOf(lease), rows })).rows_acked;
  }

  async release(lease) {
    return (await this.call('Release', { lease_id: leaseIdOf(lease) })).rows_released;
  }

  async extendLease(lease, leaseS) {
    const res = await this.call('ExtendLease', { lease_id: leaseIdOf(lease), lease_ms: Math.round(leaseS * 1000) });
    return res.lease_expires_unix_ms;
  }
}
