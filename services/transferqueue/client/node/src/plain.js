// Decoded batches -> plain JSON-safe values (for printing, logging and tests).

// int64 values become numbers when they are exactly representable, strings otherwise.
function plainNumber(v) {
  if (typeof v !== 'bigint') return v;
  return v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v.toString();
}

export function toPlain(value) {
  if (ArrayBuffer.isView(value)) return Array.from(value, plainNumber);
  if (Array.isArray(value)) return value.map(toPlain);
  if (value && typeof value === 'object') {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, toPlain(v)]));
  }
  return plainNumber(value);
}

// {partition, rows, leaseId, complete, columns, schema} with every column as plain arrays.
export function batchToPlain(batch) {
  return {
    partition: batch.partition,
    rows: batch.rows,
    leaseId: batch.leaseId,
    complete: batch.complete,
    schema: batch.schema,
    columns: toPlain(batch.columns),
  };
}
