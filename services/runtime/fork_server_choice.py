"""Which fork server (services/runtime/fork_server.py) a launcher forks its Python services from: one it starts
(`start_fork_server`), the running one env SLUICE_FORK_SERVER names (`fork_server_for`: the test suite's workers
name theirs to the `sluice` commands they run), or, for a TransferQueue or coordinator started without one, the
one its caller keeps for its whole life (`stack_forker`)."""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from services.runtime.forked_process import PRELOAD, ForkServerClient
from services.runtime.processes import Reaper, child_env

FORK_SERVER_ENV = "SLUICE_FORK_SERVER"  # a running fork server's socket, for launchers to share (fork_server_for)


def start_fork_server(
    env: dict | None = None, preload: Sequence[str] = PRELOAD, listen: str | None = None
) -> ForkServerClient | None:
    """A fork server (services/runtime/fork_server.py) for this launcher's Python services, its children and itself
    registered with the reaper, in the environment `env` adds to child_env's (its children's, so that they
    can be forked); with `listen`, other launchers may connect on that unix socket. None off Linux, where
    forking a process that has imported torch is not safe (macOS: the Objective-C runtime)."""
    if sys.platform != "linux":
        return None
    reaper_ = Reaper.get()
    server = ForkServerClient.start(child_env(env), reaper_.register, preload, listen)
    assert server.proc is not None
    reaper_.register(server.proc.pid)
    return server


def fork_server_for(env: dict | None = None) -> ForkServerClient | None:
    """The fork server env SLUICE_FORK_SERVER names (a socket a running server listens on, fork_server.py
    --listen), when it answers and can fork children of this environment (see start_fork_server); else a new
    one. Closing the one connected to ends the connection only."""
    path = os.environ.get(FORK_SERVER_ENV, "")
    if path and sys.platform == "linux":
        try:
            server = ForkServerClient.connect(path, Reaper.get().register)
        except OSError:
            return start_fork_server(env)  # gone (a test worker that exited): as without one
        if server.can_fork(child_env(env)):
            return server
        server.close()
    return start_fork_server(env)


_stack_forker: Callable[[], ForkServerClient | None] | None = None


def fork_stacks_from(source: Callable[[], ForkServerClient | None] | None) -> None:
    """Where a TransferQueue or coordinator started without a fork server (LocalTransferQueue, LocalDCS without
    `forker`) forks its processes from: `source()`, a server its caller keeps for its whole life (the test
    suite's workers: tests/worker_fork_server.py); None (the default): each is started as a new interpreter."""
    global _stack_forker
    _stack_forker = source


def stack_forker(given: ForkServerClient | None) -> ForkServerClient | None:
    """`given`, else the one fork_stacks_from named (or None)."""
    if given is not None or _stack_forker is None:
        return given
    return _stack_forker()
