"""Wake-ups for long polls, shared by every replica of a service: writers PUBLISH a topic name on a
Redis channel when the state behind it changed; each process keeps one asyncio Event per topic that
its waiters await (TransferQueue: topic = partition; DCS: topic = weights / run / topology)."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

log = logging.getLogger(__name__)


class RedisEvents:
    def __init__(self, redis: aioredis.Redis, channel: str):
        self._redis = redis
        self._channel = channel
        self._events: dict[str, asyncio.Event] = {}
        self.subscribed = asyncio.Event()

    def waiter(self, topic: str) -> asyncio.Event:
        """Take this *before* checking state: a change after the check still sets it."""
        event = self._events.get(topic)
        if event is None:
            event = self._events[topic] = asyncio.Event()
        return event

    def fire(self, topic: str) -> None:
        event = self._events.pop(topic, None)
        if event is not None:
            event.set()

    def fire_all(self) -> None:
        for topic in list(self._events):
            self.fire(topic)

    async def run(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                self.subscribed.set()
                # anything published while we were away is covered by waking everyone once
                self.fire_all()
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        self.fire(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: waiters fall back to their timeouts
                self.subscribed.clear()
                log.warning("event subscription lost; retrying", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass
