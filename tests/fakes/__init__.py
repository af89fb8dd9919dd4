"""In-memory fakes of the seams roles are given (services/run_state/seams.py, and the rollout's engines in
services/rollout/engine_pool.py), for unit tests that run a role in milliseconds, without Redis, gRPC servers or
processes. Each keeps the semantics its role relies on (see each module). FakeRunSession bundles them into the
session a role's loop is given (services/role/session.py)."""

from tests.fakes.data_plane import AsyncInMemoryDataPlane, InMemoryDataPlane
from tests.fakes.engines import FakeEngines
from tests.fakes.run_state import FakeMembership, InMemoryEvaluations, InMemoryLedger, InMemoryRedis, ProgressBox
from tests.fakes.session import FakeRunSession
from tests.fakes.weights import InMemoryCoordinator

__all__ = [
    "AsyncInMemoryDataPlane",
    "FakeEngines",
    "FakeMembership",
    "FakeRunSession",
    "InMemoryCoordinator",
    "InMemoryDataPlane",
    "InMemoryEvaluations",
    "InMemoryLedger",
    "InMemoryRedis",
    "ProgressBox",
]
