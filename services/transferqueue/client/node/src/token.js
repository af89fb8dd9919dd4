// The stack's bearer token as every Sluice service reads it: the file named by SLUICE_AUTH_TOKEN_FILE,
// else SLUICE_AUTH_TOKEN, else none. Never a command-line argument: every user of the machine can read
// a process's arguments.
import { readFileSync } from 'node:fs';

import { Status, TQError } from './errors.js';

export function tokenFromEnv(env = process.env) {
  const file = env.SLUICE_AUTH_TOKEN_FILE;
  if (file) {
    let token;
    try {
      token = readFileSync(file, 'utf8').trim();
    } catch (err) {
      throw new TQError(Status.INVALID_ARGUMENT, `SLUICE_AUTH_TOKEN_FILE ${file}: ${err.message}`);
    }
    if (!token) throw new TQError(Status.INVALID_ARGUMENT, `SLUICE_AUTH_TOKEN_FILE ${file} is empty`);
    return token;
  }
  return env.SLUICE_AUTH_TOKEN ?? '';
}
