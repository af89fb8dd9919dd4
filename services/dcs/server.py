"""The coordinator's service loop: uvicorn serving the FastAPI app until `stop` is set."""

from __future__ import annotations

import asyncio
import logging

from services.dcs.app import build_app
from services.dcs.config import DCSConfig
from services.dcs.state import RedisState
from services.runtime.http_service import serve_http
from services.runtime.redis_events import RedisEvents

log = logging.getLogger(__name__)


async def serve(config: DCSConfig, stop: asyncio.Event) -> None:
    state = RedisState(config.redis_url, config.key_prefix, config.node_lease_s, config.dead_node_ttl_s)
    events = RedisEvents(state.redis, state.events_channel)
    events_task = asyncio.create_task(events.run())
    log.info("dcs serving", extra={"port": config.port, "redis": config.redis_url})
    try:
        await serve_http(build_app(config, state, events), config.host, config.port, stop, tls=config)
    finally:
        log.info("dcs stopping")
        events_task.cancel()
        await asyncio.gather(events_task, return_exceptions=True)
        await state.close()
        log.info("dcs stopped")
