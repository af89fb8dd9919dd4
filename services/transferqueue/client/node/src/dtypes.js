// Sluice dtype names <-> Arrow types and JavaScript typed arrays (mirrors wire_format.WIRE_TYPES).
import * as arrow from 'apache-arrow';

import { invalid } from './errors.js';

// The field metadata key every column carries (shards reject columns without it).
export const DTYPE_META = 'sluice.dtype';

// dtype -> [Arrow type of the wire bits, typed array a put takes and a read gives back]
const TABLE = {
  int64: [() => new arrow.Int64(), BigInt64Array],
  int32: [() => new arrow.Int32(), Int32Array],
  int16: [() => new arrow.Int16(), Int16Array],
  int8: [() => new arrow.Int8(), Int8Array],
  uint8: [() => new arrow.Uint8(), Uint8Array],
  float64: [() => new arrow.Float64(), Float64Array],
  float32: [() => new arrow.Float32(), Float32Array],
  // no native 16-bit floats in JavaScript: read back as Float32Array, not writable from Node (yet)
  float16: [() => new arrow.Float16(), Float32Array],
  bfloat16: [() => new arrow.Uint16(), Float32Array], // travels as uint16 bit patterns
  bool: [() => new arrow.Bool(), Array],
};

export const DTYPES = Object.keys(TABLE);
const WRITABLE = new Set(DTYPES.filter((d) => d !== 'float16' && d !== 'bfloat16'));

export function isDtype(name) {
  return Object.prototype.hasOwnProperty.call(TABLE, name);
}

export function arrowType(dtype) {
  return TABLE[dtype][0]();
}

export function arrayType(dtype) {
  return TABLE[dtype][1];
}

export function isWritable(dtype) {
  return WRITABLE.has(dtype);
}

// The dtype of a typed array handed to put (null for anything else).
export function dtypeOfTypedArray(value) {
  if (value instanceof BigInt64Array) return 'int64';
  if (value instanceof Int32Array) return 'int32';
  if (value instanceof Int16Array) return 'int16';
  if (value instanceof Int8Array) return 'int8';
  if (value instanceof Uint8Array) return 'uint8';
  if (value instanceof Float64Array) return 'float64';
  if (value instanceof Float32Array) return 'float32';
  return null;
}

// Plain JavaScript values typed as numpy would: all integers (or bigints) -> int64, all booleans
// -> bool, other numbers -> float64, no values at all -> float64.
export function inferDtype(values) {
  if (!values.length) return 'float64';
  let sawFloat = false;
  let sawBool = false;
  let sawInt = false;
  for (const v of values) {
    if (typeof v === 'boolean') sawBool = true;
    else if (typeof v === 'bigint' || (typeof v === 'number' && Number.isInteger(v))) sawInt = true;
    else if (typeof v === 'number') sawFloat = true;
    else return null;
  }
  if (sawBool) return sawInt || sawFloat ? null : 'bool';
  return sawFloat ? 'float64' : 'int64';
}

// Values (typed array or plain array) as the typed array of `dtype`; booleans as a plain array.
export function toTypedArray(dtype, values, where) {
  const Ctor = arrayType(dtype);
  if (values instanceof Ctor) return values;
  if (dtype === 'bool') return Array.from(values, (v) => Boolean(v));
  if (dtype === 'int64') {
    return BigInt64Array.from(values, (v) => {
      if (typeof v === 'bigint') return v;
      if (!Number.isInteger(v)) throw invalid(`${where}: ${v} is not an integer`);
      return BigInt(v);
    });
  }
  const integral = dtype !== 'float32' && dtype !== 'float64';
  return Ctor.from(values, (v) => {
    const n = Number(v);
    if (typeof v !== 'number' && typeof v !== 'bigint') throw invalid(`${where}: ${v} is not a number`);
    if (integral && (!Number.isInteger(n) || Ctor.of(n)[0] !== n)) {
      throw invalid(`${where}: ${v} is not a ${dtype}`);
    }
    return n;
  });
}

// 16-bit float bit patterns -> Float32Array.
export function halfBitsToFloat32(bits) {
  const out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) {
    const h = bits[i];
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    if (exp === 0) out[i] = sign * 2 ** -14 * (frac / 1024);
    else if (exp === 0x1f) out[i] = frac ? NaN : sign * Infinity;
    else out[i] = sign * 2 ** (exp - 15) * (1 + frac / 1024);
  }
  return out;
}

// bfloat16 bit patterns (the top half of a float32) -> Float32Array.
export function bfloat16BitsToFloat32(bits) {
  const wide = new Uint32Array(bits.length);
  for (let i = 0; i < bits.length; i++) wide[i] = bits[i] << 16;
  return new Float32Array(wide.buffer);
}
