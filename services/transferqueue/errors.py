"""The one error type of the data plane: a gRPC status code plus a message naming what was wrong."""

from __future__ import annotations

import re

import grpc

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class TQError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "TQError":
        return cls(err.code(), err.details() or "")


def check_name(kind: str, name: str) -> str:
    """Partition, task and field names become Redis key parts: keep them to a safe alphabet."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise TQError(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{kind} name {name!r} is invalid: use 1-128 characters of A-Z a-z 0-9 _ . -")
    return name
