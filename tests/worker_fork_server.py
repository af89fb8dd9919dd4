"""This test process's fork server (services/runtime/fork_server.py), started on first use: the whole runs, engines
and services the tests start are forked from it, so torch's and transformers' imports (~6 CPU s a process) are
paid once per pytest worker instead of once per process started. It listens on a socket that env
SLUICE_FORK_SERVER names, so the `sluice run` and `sluice demo` processes the tests start fork their services
from it too (fork_server_choice.fork_server_for). A process whose import-time environment differs is started as before
(ChildProcess falls back to exec)."""

from __future__ import annotations

import os
import tempfile

from services.launch.local_run import SERVICE_ENV
from services.runtime.forked_process import ForkServerClient
from services.runtime.fork_server_choice import FORK_SERVER_ENV, start_fork_server

_server: ForkServerClient | None = None


def worker_fork_server() -> ForkServerClient | None:
    """The server (a new one if the last is gone); None off Linux, where nothing is forked."""
    global _server
    if _server is None or _server.gone:
        socket_path = os.path.join(tempfile.mkdtemp(prefix="sluice-fork-"), "server.sock")  # a 0700 directory
        _server = start_fork_server(SERVICE_ENV, listen=socket_path)
        if _server is not None:
            os.environ[FORK_SERVER_ENV] = socket_path
    return _server


def close_worker_fork_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None
