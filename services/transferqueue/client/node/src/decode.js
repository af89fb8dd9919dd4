// Arrow IPC -> columns, as the Python client's codec.decode_table reads them.
//
// A read gives back, per field:
//   SCALAR  a typed array (int64: BigInt64Array, float32: Float32Array, ...; bool: an array of
//           booleans; float16 and bfloat16: Float32Array)
//   RAGGED  an array with one typed array per row
//   TENSOR  {shape: [rows, ...shape], data: the flat typed array}
//   STRING  an array of strings
import * as arrow from 'apache-arrow';

import { DTYPE_META, arrayType, bfloat16BitsToFloat32, halfBitsToFloat32, isDtype } from './dtypes.js';
import { Status, TQError } from './errors.js';

const TENSOR_EXTENSION = 'arrow.fixed_shape_tensor';

function dataLoss(message) {
  return new TQError(Status.DATA_LOSS, message);
}

// The wire values of one flat vector (or typed array) as the array a read gives back for `dtype`.
function numeric(dtype, values) {
  const flat = ArrayBuffer.isView(values) || Array.isArray(values) ? values : values.toArray();
  if (dtype === 'float16') return halfBitsToFloat32(flat);
  if (dtype === 'bfloat16') return bfloat16BitsToFloat32(flat);
  if (dtype === 'bool') return Array.from(flat, Boolean);
  const Ctor = arrayType(dtype);
  return flat instanceof Ctor ? flat : Ctor.from(flat);
}

function kindOf(field) {
  const typeId = field.type.typeId;
  if (typeId === arrow.Type.LargeUtf8) return 'STRING';
  if (typeId === arrow.Type.LargeList) return 'RAGGED';
  if (typeId === arrow.Type.FixedSizeList && field.metadata.get('ARROW:extension:name') === TENSOR_EXTENSION) {
    return 'TENSOR';
  }
  return 'SCALAR';
}

function tensorShape(field) {
  try {
    return JSON.parse(field.metadata.get('ARROW:extension:metadata')).shape.map(Number);
  } catch {
    throw dataLoss(`column ${field.name}: unreadable ${TENSOR_EXTENSION} metadata`);
  }
}

function decodeColumn(vector, field, dtype) {
  const kind = kindOf(field);
  if (vector.nullCount) throw dataLoss(`column ${field.name}: stored column has nulls`);
  if (kind === 'STRING') return { kind, shape: [], value: vector.toArray() };
  if (kind === 'RAGGED') {
    const value = Array.from({ length: vector.length }, (_, i) => numeric(dtype, vector.get(i)));
    return { kind, shape: [], value };
  }
  if (kind === 'TENSOR') {
    const shape = tensorShape(field);
    const width = field.type.listSize;
    const data = new (arrayType(dtype))(vector.length * width);
    for (let i = 0; i < vector.length; i++) {
      const row = numeric(dtype, vector.get(i));
      if (dtype === 'bool') row.forEach((v, k) => { data[i * width + k] = v; });
      else data.set(row, i * width);
    }
    return { kind, shape, value: { shape: [vector.length, ...shape], data } };
  }
  return { kind, shape: [], value: numeric(dtype, vector) };
}

// -> {n, columns: {name: value}, schema: {name: {dtype, kind, shape}}}
export function fromIpc(bytes) {
  let table;
  try {
    table = arrow.tableFromIPC(bytes);
  } catch (err) {
    throw dataLoss(`malformed Arrow IPC stream: ${err.message}`);
  }
  const columns = {};
  const schema = {};
  for (const field of table.schema.fields) {
    const dtype = field.metadata.get(DTYPE_META) ?? '';
    if (dtype !== 'string' && !isDtype(dtype)) {
      throw dataLoss(`column ${field.name} carries unknown dtype ${JSON.stringify(dtype)}`);
    }
    const { kind, shape, value } = decodeColumn(table.getChild(field.name), field, dtype);
    columns[field.name] = value;
    schema[field.name] = { dtype, kind, shape };
  }
  return { n: table.numRows, columns, schema };
}

// Per-shard decoded parts [{positions, decoded}] -> one set of columns in request order.
export function mergeInOrder(parts, n) {
  if (parts.length === 1) return parts[0].decoded;
  const first = parts[0].decoded;
  const columns = {};
  for (const name of Object.keys(first.columns)) {
    columns[name] = mergeColumn(parts.map((p) => [p.positions, p.decoded.columns[name]]), n);
  }
  return { n, columns, schema: first.schema };
}

function mergeColumn(pieces, n) {
  const sample = pieces[0][1];
  if (sample && sample.data !== undefined && sample.shape !== undefined) {
    const width = sample.shape.slice(1).reduce((a, b) => a * b, 1);
    const data = new sample.data.constructor(n * width);
    for (const [positions, piece] of pieces) {
      positions.forEach((p, i) => {
        for (let k = 0; k < width; k++) data[p * width + k] = piece.data[i * width + k];
      });
    }
    return { shape: [n, ...sample.shape.slice(1)], data };
  }
  const out = ArrayBuffer.isView(sample) ? new sample.constructor(n) : new Array(n);
  for (const [positions, piece] of pieces) positions.forEach((p, i) => { out[p] = piece[i]; });
  return out;
}
