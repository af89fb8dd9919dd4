"""The one error a reward function raises, so the rollout loop has one thing to catch."""

from __future__ import annotations

from typing import Literal

FailureKind = Literal["exception", "timeout"]


class RewardError(RuntimeError):
    """A reward could not be computed for a sample: the function failed, returned something that is
    not a finite number, or the remote endpoint refused or kept failing. `kind` says which way:
    "timeout" when it gave no answer in time (after its retries), else "exception"."""

    def __init__(self, message: str, kind: FailureKind = "exception"):
        super().__init__(message)
        self.kind: FailureKind = kind
