#!/usr/bin/env node
// A round trip through a running TransferQueue: create a partition, register a task, put rows
// (an int64 scalar, a float32 scalar and a ragged float32 column), claim them, read them back
// with get, ack, and print what was read as one JSON object.
//
//   node examples/roundtrip.mjs --controller 127.0.0.1:50051 [--partition P] [--task T]
import { parseArgs } from 'node:util';

import { TransferQueueClient, batchToPlain } from '../src/index.js';

const { values: args } = parseArgs({
  options: {
    controller: { type: 'string' },
    partition: { type: 'string', default: `node_roundtrip_${process.pid}` },
    task: { type: 'string', default: `node_task_${process.pid}` },
  },
});
if (!args.controller) {
  console.error('usage: roundtrip.mjs --controller HOST:PORT [--partition P] [--task T]');
  process.exit(2);
}

// the token: env SLUICE_AUTH_TOKEN_FILE or SLUICE_AUTH_TOKEN (never an argument: the process list shows those)
const client = new TransferQueueClient(args.controller);
try {
  await client.createPartition(args.partition);
  await client.registerTask(args.task, ['id', 'score', 'logprobs']);
  const rows = await client.put(args.partition, {
    id: BigInt64Array.from([10n, 11n, 12n]),
    score: Float32Array.from([0.5, -1.25, 3]),
    logprobs: [Float32Array.from([-0.5, -1.5]), new Float32Array(0), Float32Array.from([-0.25, -2, -4])],
  });
  const claimed = await client.claim(args.partition, args.task, 3, { waitS: 5 });
  const read = await client.get(args.partition, claimed.rows, ['id', 'score', 'logprobs']);
  const acked = await client.ack(claimed);
  console.log(JSON.stringify({ put: rows, claimed: batchToPlain(claimed), get: batchToPlain(read), acked }));
} finally {
  client.close();
}
