"""This test process's fork server (services/runtime/fork_server.py), started on first use: the whole runs, engines
and services the tests start are forked from it, so torch's and transformers' imports (~4 CPU s a process) are
paid once per pytest worker instead of once per process started. A process whose import-time environment differs
(a run with a python_path) is started as before (ChildProcess falls back to exec)."""

from __future__ import annotations

from services.launch.local_run import SERVICE_ENV
from services.runtime.forked_process import ForkServerClient
from services.runtime.processes import start_fork_server

_server: ForkServerClient | None = None


def worker_fork_server() -> ForkServerClient | None:
    """The server (a new one if the last is gone); None off Linux, where nothing is forked."""
    global _server
    if _server is None or _server.gone:
        _server = start_fork_server(SERVICE_ENV)
    return _server


def close_worker_fork_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None
