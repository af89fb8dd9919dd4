// gRPC plumbing shared by the controller and shard clients: channel options, bearer-token
// metadata, deadlines and Promise wrappers that turn every failure into a TQError.
import fs from 'node:fs';

import grpc from '@grpc/grpc-js';

import { Status, TQError } from './errors.js';

// The servers accept and send messages up to 64 MiB (grpc's usual 4 MiB is too small for a 4 MiB
// data chunk plus framing).
export const MAX_MESSAGE_BYTES = 64 << 20;
export const CHANNEL_OPTIONS = {
  'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
  'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
  'grpc.keepalive_time_ms': 30_000,
};

// TLS for an address written tls://host:port, as the Python client: the server is verified against
// SLUICE_TLS_CA_FILE when set (else the system's CAs), and SLUICE_TLS_CLIENT_CERT_FILE /
// SLUICE_TLS_CLIENT_KEY_FILE are presented when set (servers that require client certificates).
export const TLS_SCHEME = 'tls://';

function tlsCredentials(env) {
  const read = (name) => (env[name] ? fs.readFileSync(env[name]) : null);
  const [ca, cert, key] = [read('SLUICE_TLS_CA_FILE'), read('SLUICE_TLS_CLIENT_CERT_FILE'),
    read('SLUICE_TLS_CLIENT_KEY_FILE')];
  if (Boolean(cert) !== Boolean(key)) {
    throw new TQError(Status.INVALID_ARGUMENT,
      'SLUICE_TLS_CLIENT_CERT_FILE and SLUICE_TLS_CLIENT_KEY_FILE go together');
  }
  return grpc.credentials.createSsl(ca, key, cert);
}

export function makeClient(Ctor, address, env = process.env) {
  if (address.startsWith(TLS_SCHEME)) {
    return new Ctor(address.slice(TLS_SCHEME.length), tlsCredentials(env), CHANNEL_OPTIONS);
  }
  return new Ctor(address, grpc.credentials.createInsecure(), CHANNEL_OPTIONS);
}

// `address` dialled with TLS when `tls` (a shard is dialled the way its controller is).
export function withTls(address, tls) {
  return tls && !address.startsWith(TLS_SCHEME) ? TLS_SCHEME + address : address;
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
