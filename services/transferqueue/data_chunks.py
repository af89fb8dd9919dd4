"""Fast path for the bulk messages PutChunk and DataChunk (both carry their bytes in field 2, `data`).

Going through protobuf objects copies every chunk twice more than needed; these produce and read the
same wire bytes directly: a chunk is `[header fields] + 0x12 <varint length> <data>`, and protobuf
defines the concatenation of encoded messages as their merge, so any protobuf implementation reads
them as ordinary PutChunk/DataChunk messages."""

from __future__ import annotations

_DATA_TAG = 0x12  # field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_chunk(data, head: bytes = b"") -> bytes:
    """`head`: the serialized non-data fields (first message only), `data`: a bytes-like slice."""
    return b"".join((head, bytes((_DATA_TAG,)), _varint(len(data)), data))


def data_only(raw: bytes) -> memoryview | None:
    """The data of a message that holds nothing but field 2, without copying; None otherwise."""
    if not raw or raw[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(raw) and pos < 11:
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(raw)[pos:] if pos + length == len(raw) else None
        shift += 7
    return None
