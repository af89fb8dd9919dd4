"""The coordinator's service loop: uvicorn serving the FastAPI app until `stop` is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from services.dcs.app import build_app
from services.dcs.config import DCSConfig
from services.dcs.state import RedisState
from services.runtime.redis_events import RedisEvents

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def capture_signals(self):
        # the service's own SIGTERM handler (runtime.shutdown) decides when to stop
        return contextlib.nullcontext()


async def serve(config: DCSConfig, stop: asyncio.Event) -> None:
    state = RedisState(config.redis_url, config.key_prefix, config.node_lease_s)
    events = RedisEvents(state.redis, state.events_channel)
    events_task = asyncio.create_task(events.run())
    app = build_app(config, state, events)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                   access_log=False, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    log.info("dcs serving", extra={"port": config.port, "redis": config.redis_url})
    try:
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("dcs stopping")
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        events_task.cancel()
        await asyncio.gather(events_task, return_exceptions=True)
        await state.close()
        log.info("dcs stopped")
