// TQError: every failure of the client, carrying the gRPC status code (as the Python TQError does).
import grpc from '@grpc/grpc-js';

const CODE_NAMES = Object.fromEntries(
  Object.entries(grpc.status).filter(([, v]) => typeof v === 'number').map(([k, v]) => [v, k]),
);

export class TQError extends Error {
  // code: numeric gRPC status (grpc.status.NOT_FOUND, ...); codeName: its name ('NOT_FOUND').
  constructor(code, details) {
    const codeName = CODE_NAMES[code] ?? `CODE_${code}`;
    super(`${codeName}: ${details}`);
    this.name = 'TQError';
    this.code = code;
    this.codeName = codeName;
    this.details = details;
  }

  static fromGrpc(err) {
    if (err instanceof TQError) return err;
    if (err && typeof err.code === 'number') return new TQError(err.code, err.details || err.message);
    return new TQError(grpc.status.UNKNOWN, String(err && err.message ? err.message : err));
  }
}

export function invalid(message) {
  return new TQError(grpc.status.INVALID_ARGUMENT, message);
}

export const Status = grpc.status;
