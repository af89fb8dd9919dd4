// Columns -> Arrow IPC, exactly as the Python client's codec.encode_columns writes them.
//
// A put takes `columns`: an object of field name -> one of
//   * a typed array (BigInt64Array, Int32Array, Float32Array, ...)     -> SCALAR of that dtype
//   * an array of numbers / bigints / booleans                        -> SCALAR (int64, float64 or bool)
//   * an array of strings                                             -> STRING
//   * an array of typed arrays or of number arrays                    -> RAGGED (large_list)
//   * {dtype, values}            explicit dtype                       -> SCALAR ('string': STRING)
//   * {dtype, ragged: [seq...]}  explicit dtype                       -> RAGGED
//   * {dtype, shape, values}     values flat, n * prod(shape) long    -> TENSOR (arrow.fixed_shape_tensor)
import * as arrow from 'apache-arrow';

import { DTYPE_META, arrowType, dtypeOfTypedArray, inferDtype, isDtype, isWritable, toTypedArray } from './dtypes.js';
import { invalid } from './errors.js';

const isSequence = (v) => Array.isArray(v) || (ArrayBuffer.isView(v) && !(v instanceof DataView));

function checkDtype(name, dtype) {
  if (!isDtype(dtype)) throw invalid(`field ${name}: unknown dtype ${JSON.stringify(dtype)}`);
  if (!isWritable(dtype)) throw invalid(`field ${name}: the Node client cannot write ${dtype} yet`);
}

function scalar(name, dtype, values) {
  checkDtype(name, dtype);
  const typed = toTypedArray(dtype, values, `field ${name}`);
  return { name, dtype, kind: 'SCALAR', shape: [], n: values.length, values: typed };
}

function strings(name, values) {
  if (!values.every((v) => typeof v === 'string')) throw invalid(`field ${name}: mixes strings with other values`);
  return { name, dtype: 'string', kind: 'STRING', shape: [], n: values.length, values: Array.from(values) };
}

function ragged(name, dtype, seqs) {
  if (!seqs.every(isSequence)) throw invalid(`field ${name}: ragged rows must be arrays or typed arrays`);
  if (dtype === undefined) {
    const typed = new Set(seqs.map(dtypeOfTypedArray).filter((d) => d !== null));
    if (typed.size > 1) throw invalid(`field ${name}: ragged rows mix dtypes ${[...typed].sort()}`);
    dtype = typed.size ? [...typed][0] : inferDtype(seqs.flatMap((s) => Array.from(s)));
    if (dtype === null) throw invalid(`field ${name}: ragged rows must hold numbers or booleans`);
  }
  checkDtype(name, dtype);
  const parts = seqs.map((s, i) => toTypedArray(dtype, s, `field ${name} row ${i}`));
  const offsets = [0];
  for (const p of parts) offsets.push(offsets[offsets.length - 1] + p.length);
  const values = dtype === 'bool' ? parts.flat() : concatTyped(parts, offsets[offsets.length - 1]);
  return { name, dtype, kind: 'RAGGED', shape: [], n: seqs.length, values, offsets };
}

function tensor(name, dtype, shape, flat) {
  checkDtype(name, dtype);
  const width = shape.reduce((a, b) => a * b, 1);
  if (!shape.length || !shape.every((d) => Number.isInteger(d) && d > 0)) {
    throw invalid(`field ${name}: per-row shape ${JSON.stringify(shape)} is empty or not positive`);
  }
  if (flat.length % width) throw invalid(`field ${name}: ${flat.length} values do not fill rows of shape ${shape}`);
  const values = toTypedArray(dtype, flat, `field ${name}`);
  return { name, dtype, kind: 'TENSOR', shape: [...shape], n: flat.length / width, values, width };
}

function concatTyped(parts, total) {
  const out = new parts[0].constructor(total);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

// One put column -> its normalized form {name, dtype, kind, shape, n, values[, offsets | width]}.
export function normalizeColumn(name, value) {
  const typedDtype = ArrayBuffer.isView(value) ? dtypeOfTypedArray(value) : null;
  if (typedDtype) return scalar(name, typedDtype, value);
  if (Array.isArray(value)) {
    if (!value.length) throw invalid(`field ${name}: empty list`);
    if (typeof value[0] === 'string') return strings(name, value);
    if (isSequence(value[0])) return ragged(name, undefined, value);
    const dtype = inferDtype(value);
    if (dtype === null) throw invalid(`field ${name}: a list must hold strings, numbers or 1-D sequences`);
    return scalar(name, dtype, value);
  }
  if (value && typeof value === 'object' && typeof value.dtype === 'string') {
    if (value.ragged !== undefined) return ragged(name, value.dtype, value.ragged);
    if (value.shape !== undefined && value.shape.length) return tensor(name, value.dtype, value.shape, value.values);
    if (value.dtype === 'string') return strings(name, value.values);
    return scalar(name, value.dtype, value.values);
  }
  throw invalid(`field ${name}: unsupported column value`);
}

// -> {n, schemas (FieldSchema messages), columns (normalized)}; every column must have n rows.
export function encodeColumns(columns) {
  const names = Object.keys(columns || {});
  if (!names.length) throw invalid('a put needs at least one column');
  const normalized = names.map((name) => normalizeColumn(name, columns[name]));
  const n = normalized[0].n;
  for (const col of normalized) {
    if (col.n !== n) throw invalid(`field ${col.name} has ${col.n} rows; ${names[0]} has ${n}`);
  }
  if (n === 0) throw invalid('a put needs at least one row');
  const schemas = normalized.map((c) => ({ name: c.name, dtype: c.dtype, kind: c.kind, shape: c.shape }));
  return { n, schemas, columns: normalized };
}

// An array like `like` (typed or plain) holding `values`.
const sameKind = (like, values) => (Array.isArray(like) ? values : like.constructor.from(values));

// Rows [first, first + n) of a normalized column, without copying typed arrays.
function sliceRows(col, first, n) {
  const cut = (from, to) => (Array.isArray(col.values) ? col.values.slice(from, to) : col.values.subarray(from, to));
  if (col.kind === 'RAGGED') {
    const offsets = col.offsets.slice(first, first + n + 1);
    const base = offsets[0];
    return { ...col, n, values: cut(base, offsets[n]), offsets: offsets.map((o) => o - base) };
  }
  const width = col.kind === 'TENSOR' ? col.width : 1;
  return { ...col, n, values: cut(first * width, (first + n) * width) };
}

// The rows at `positions` of a normalized column (a slice when they are contiguous, the usual case).
export function selectRows(col, positions) {
  const n = positions.length;
  if (positions.every((p, i) => p === positions[0] + i)) {
    return n === col.n ? col : sliceRows(col, positions[0], n);
  }
  if (col.kind === 'SCALAR' || col.kind === 'STRING') {
    return { ...col, n, values: sameKind(col.values, positions.map((p) => col.values[p])) };
  }
  const gathered = [];
  const offsets = [0];
  for (const p of positions) {
    const start = col.kind === 'RAGGED' ? col.offsets[p] : p * col.width;
    const end = col.kind === 'RAGGED' ? col.offsets[p + 1] : start + col.width;
    for (let k = start; k < end; k++) gathered.push(col.values[k]);
    offsets.push(gathered.length);
  }
  const values = sameKind(col.values, gathered);
  return col.kind === 'RAGGED' ? { ...col, n, values, offsets } : { ...col, n, values };
}

function packBits(bools) {
  const out = new Uint8Array(Math.ceil(bools.length / 8));
  bools.forEach((b, i) => { if (b) out[i >> 3] |= 1 << (i & 7); });
  return out;
}

function flatData(dtype, values) {
  const type = arrowType(dtype);
  const data = dtype === 'bool' ? packBits(values) : values;
  return arrow.makeData({ type, length: values.length, data });
}

// Python's pyarrow names a list's child field "item" and makes it nullable: the shard concatenates
// chunks of one field put by different clients, which needs identical Arrow types.
const itemField = (dtype) => new arrow.Field('item', arrowType(dtype), true);

function columnData(col) {
  if (col.kind === 'SCALAR') return flatData(col.dtype, col.values);
  if (col.kind === 'STRING') return arrow.vectorFromArray(col.values, new arrow.LargeUtf8()).data[0];
  const child = flatData(col.dtype, col.values);
  if (col.kind === 'RAGGED') {
    const type = new arrow.LargeList(itemField(col.dtype));
    return arrow.makeData({ type, length: col.n, valueOffsets: BigInt64Array.from(col.offsets, BigInt), child });
  }
  const type = new arrow.FixedSizeList(col.width, itemField(col.dtype));
  return arrow.makeData({ type, length: col.n, child });
}

function columnField(col, type) {
  const metadata = new Map([[DTYPE_META, col.dtype]]);
  if (col.kind === 'TENSOR') {
    metadata.set('ARROW:extension:name', 'arrow.fixed_shape_tensor');
    metadata.set('ARROW:extension:metadata', JSON.stringify({ shape: col.shape }));
  }
  return new arrow.Field(col.name, type, false, metadata);
}

// Normalized columns (all with the same n) -> one Arrow IPC stream (Uint8Array).
export function toIpc(columns) {
  const datas = columns.map(columnData);
  const fields = columns.map((col, i) => columnField(col, datas[i].type));
  const n = columns[0].n;
  const struct = arrow.makeData({ type: new arrow.Struct(fields), length: n, children: datas });
  const batch = new arrow.RecordBatch(new arrow.Schema(fields), struct);
  return arrow.tableToIPC(new arrow.Table(batch), 'stream');
}
