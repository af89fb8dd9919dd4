#!/usr/bin/env node
// A JSON-in, JSON-out front end to TransferQueueClient (the cross-language test drives it).
//
//   cli.mjs put   --controller A --partition P --columns '{"x": {"dtype": "int64", "values": [1, 2]}}'
//                 [--create] [--group-size N] [--rows '[0, 1]']
//   cli.mjs claim --controller A --partition P --task T --batch-size N [--wait-s S] [--ack]
//   cli.mjs get   --controller A --partition P --rows '[0, 1]' --fields '["x"]'
//
// Prints one JSON object. A failure prints {"error": {code, codeName, details}} and exits with 3.
import { parseArgs } from 'node:util';

import { TransferQueueClient, batchToPlain } from '../src/index.js';

const { values: args, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    controller: { type: 'string' },
    partition: { type: 'string' },
    task: { type: 'string' },
    columns: { type: 'string' },
    rows: { type: 'string' },
    fields: { type: 'string' },
    create: { type: 'boolean', default: false },
    'group-size': { type: 'string', default: '1' },
    'batch-size': { type: 'string', default: '1' },
    'wait-s': { type: 'string', default: '0' },
    ack: { type: 'boolean', default: false },
  },
});

async function put(client) {
  if (args.create) await client.createPartition(args.partition, { groupSize: Number(args['group-size']) });
  const rows = args.rows ? JSON.parse(args.rows) : undefined;
  return { rows: await client.put(args.partition, JSON.parse(args.columns), { rows }) };
}

async function claim(client) {
  const batch = await client.claim(args.partition, args.task, Number(args['batch-size']),
    { waitS: Number(args['wait-s']) });
  const acked = args.ack && batch.rows.length ? await client.ack(batch) : 0;
  return { ...batchToPlain(batch), acked };
}

async function get(client) {
  return batchToPlain(await client.get(args.partition, JSON.parse(args.rows), JSON.parse(args.fields)));
}

const commands = { put, claim, get };
const command = commands[positionals[0]];
if (!command || !args.controller || !args.partition) {
  console.error('usage: cli.mjs put|claim|get --controller HOST:PORT --partition P ... (see the file header)');
  process.exit(2);
}
// the token: env SLUICE_AUTH_TOKEN_FILE or SLUICE_AUTH_TOKEN (never an argument: the process list shows those)
let client;
try {
  client = new TransferQueueClient(args.controller);
  console.log(JSON.stringify(await command(client)));
} catch (err) {
  const { code, codeName, details } = err;
  const error = { code: code ?? null, codeName: codeName ?? null, details: details ?? err.message };
  console.log(JSON.stringify({ error }));
  process.exitCode = 3;
} finally {
  client?.close();
}
