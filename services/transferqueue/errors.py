"""The one error type of the data plane: a gRPC status code plus a message naming what was wrong."""

from __future__ import annotations

import re

import grpc

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# partitions and tasks may carry one scope ("<scope>/<name>", e.g. a run id): a scoped task applies only to
# partitions of the same scope
_SCOPED_NAME = re.compile(r"^([A-Za-z0-9_.\-]{1,128}/)?[A-Za-z0-9_.\-]{1,128}$")
_SCOPED_KINDS = frozenset({"partition", "task"})


class TQError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "TQError":
        return cls(err.code(), err.details() or "")


def check_name(kind: str, name: str) -> str:
    """Partition, task and field names become Redis key parts: keep them to a safe alphabet. Partition and
    task names may start with one scope and a slash ("run-a/train_3")."""
    if kind in _SCOPED_KINDS:
        if not isinstance(name, str) or not _SCOPED_NAME.match(name):
            raise TQError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{kind} name {name!r} is invalid: use 1-128 characters of A-Z a-z 0-9 _ . -, "
                "optionally after a scope of the same characters and a slash",
            )
        return name
    if not isinstance(name, str) or not _NAME.match(name):
        raise TQError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{kind} name {name!r} is invalid: use 1-128 characters of A-Z a-z 0-9 _ . -",
        )
    return name


def task_applies(partition: str, task: str) -> bool:
    """A task without a scope applies to every partition; "<scope>/<task>" only to "<scope>/..." ones."""
    scope, sep, _ = task.partition("/")
    return not sep or partition.startswith(scope + "/")
