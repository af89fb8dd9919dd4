"""The entry point every service shares: config from flags/env, JSON logs, /metrics, then the
service's async `serve(config, stop)` until SIGTERM/SIGINT sets `stop`."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence, TypeVar

from pydantic_settings import BaseSettings

from services.runtime.heap import manage_service_heap
from services.runtime.logs import configure_logging
from services.runtime.metrics import serve_metrics
from services.runtime.settings_cli import parse_settings
from services.runtime.shutdown import shutdown_event
from services.runtime.spans import RECORDER
from services.runtime.startup import StartupError, log_service_start

C = TypeVar("C", bound=BaseSettings)


class ServiceFailed(RuntimeError):
    """Raised by a service's serve() that cannot go on (its state may be corrupt): logged, and the process
    exits 1 so that its supervisor (compose, k8s, `sluice run`) restarts it."""


def run_service(
    model: type[C], command: str, serve: Callable[[C, asyncio.Event], Awaitable[None]], argv: Sequence[str] | None
) -> int:
    config = parse_settings(model, argv, f"sluice {command}", model.__doc__)
    configure_logging(command, config.log_level)  # type: ignore[attr-defined]  # every service's settings have it
    log_service_start(command)
    serve_metrics(config.host, getattr(config, "metrics_port", 0))  # type: ignore[attr-defined]  # and this
    role = getattr(config, "role", None)  # forward: actor_fwd | reference; trainer: actor | critic
    RECORDER.service = (
        command if role in (None, command, "actor") else role if command == "forward" else f"{command}-{role}"
    )

    async def run() -> None:
        await serve(config, shutdown_event())

    manage_service_heap()  # freezes the imports; a role or the engine freezes again once its model is loaded

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run())
    except StartupError as exc:  # e.g. a model directory: names it and the missing file; a traceback adds nothing
        logging.getLogger(command).error(str(exc))
        return 2
    except ServiceFailed as exc:
        logging.getLogger(command).error(f"stopped on an error: {exc}")
        return 1
    return 0


def _loop_factory():
    """uvloop's event loop when it is installed (HTTP handling costs the engine less CPU), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
