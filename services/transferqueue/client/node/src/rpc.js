// gRPC plumbing shared by the controller and shard clients: channel options, bearer-token
// metadata, deadlines and Promise wrappers that turn every failure into a TQError.
import grpc from '@grpc/grpc-js';

import { TQError } from './errors.js';

// The servers accept and send messages up to 64 MiB (grpc's usual 4 MiB is too small for a 4 MiB
// data chunk plus framing).
export const MAX_MESSAGE_BYTES = 64 << 20;
export const CHANNEL_OPTIONS = {
  'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
  'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
  'grpc.keepalive_time_ms': 30_000,
};

export function makeClient(Ctor, address) {
  return new Ctor(address, grpc.credentials.createInsecure(), CHANNEL_OPTIONS);
}

// `authorization: Bearer <token>` when a token is set. Calls wait for the channel to be ready (up
// to their deadline) instead of failing at once, as the Python client's do.
export function callMetadata(token) {
  const md = new grpc.Metadata({ waitForReady: true });
  if (token) md.set('authorization', `Bearer ${token}`);
  return md;
}

export function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

// One unary call -> Promise of the response message.
export function unary(client, method, request, { token, timeoutS }) {
  return new Promise((resolve, reject) => {
    client[method](request, callMetadata(token), { deadline: deadline(timeoutS) }, (err, response) => {
      if (err) reject(TQError.fromGrpc(err));
      else resolve(response);
    });
  });
}
