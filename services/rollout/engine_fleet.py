"""The rollout's engines as the run's engine set on the coordinator says, followed while the run goes on:

    seed       the rollout's --engine-url list is added to the run's set (unless an engine was removed since)
    every poll the set, read again:
                 an engine new to it joins the pool (it gets requests once it serves the newest weights: the
                   trainer sends them to every engine that reports an older version)
                 an engine gone from it (removed over REST, or one that registered itself and stopped) is drained:
                   its requests are resubmitted to the others
                 an added engine (one that does not register itself: an SGLang server) is kept registered by
                   the rollout, heartbeating with the version it serves; it drops out of weight syncs while
                   unreachable

Without a coordinator to follow (a role test's fakes) the pool keeps the engines it started with."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

import httpx

from services.dcs.client import DCSError
from services.dcs.models import EngineEntry, EngineList, NodeRegistration
from services.rollout.config import RolloutConfig
from services.rollout.engine_pool import Engines

log = logging.getLogger(__name__)


class EngineDirectory(Protocol):
    """Where the run's engine set is kept (DCSClient: the coordinator's /v1/runs/{run_id}/engines)."""

    def engines(self, run_id: str) -> EngineList: ...

    def add_engine(self, run_id: str, url: str, initial: bool = False) -> EngineEntry: ...


class EngineMembership(Protocol):
    """An engine's registration, kept by the rollout (RunMembership)."""

    suspended: bool

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None: ...

    def acknowledge_pause(self) -> None: ...

    def close(self) -> None: ...


def engine_registration(entry: EngineEntry, run_id: str) -> NodeRegistration:
    url = httpx.URL(entry.url)
    # the port under its scheme: the trainer reaches an https engine over TLS
    return NodeRegistration(role="engine", rank=entry.rank, host=url.host, run_id=run_id,
                            ports={url.scheme: url.port or (443 if url.scheme == "https" else 80)})


class EngineFleet:
    def __init__(self, config: RolloutConfig, pool: Engines, directory: EngineDirectory | None,
                 join: Callable[..., EngineMembership], dcs=None):
        self.config = config
        self.pool = pool
        self.directory = directory
        self.join = join
        self.dcs = dcs
        self.memberships: dict[str, EngineMembership] = {}  # url -> the registration the rollout keeps
        self._listed: set[str] = set()  # every URL the run's set has held

    async def start(self) -> None:
        """Seed the run's set with the rollout's engines and take it in; without a coordinator, register the
        rollout's engines as they are (with register_engines)."""
        if self.directory is None:
            if self.config.register_engines:
                for rank, url in enumerate(self.config.engine_urls):
                    entry = EngineEntry(url=url, source="added", rank=rank)
                    self.memberships[url] = await asyncio.to_thread(
                        self.join, self.dcs, engine_registration(entry, self.config.run_id))
            return
        if self.config.register_engines:
            for url in self.config.engine_urls:
                try:
                    await asyncio.to_thread(self.directory.add_engine, self.config.run_id, url, True)
                except DCSError as exc:
                    if exc.status != 409:
                        raise
                    log.info("not using a listed engine: it was removed from the run", extra={"engine": url})
        await self.reconcile()

    async def follow(self, poll_s: float) -> None:
        """Reconcile every poll_s until cancelled; a coordinator that does not answer is asked again."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                await self.reconcile()
            except (OSError, DCSError) as exc:
                log.warning("could not read the run's engines", extra={"error": str(exc)})

    async def reconcile(self) -> None:
        if self.directory is None:
            return
        listing = await asyncio.to_thread(self.directory.engines, self.config.run_id)
        wanted = {e.url: e for e in listing.engines if e.source == "added" or e.alive}
        self._listed.update([e.url for e in listing.engines] + listing.removed)
        for url in self.pool.urls:
            if url not in wanted and (url in self._listed or url not in self.config.engine_urls):
                self.pool.drain(url)
        for url in [u for u in self.memberships if u not in wanted or wanted[u].source != "added"]:
            await asyncio.to_thread(self.memberships.pop(url).close)
        for url, entry in wanted.items():
            self.pool.add(url)
            if entry.source == "added" and url not in self.memberships:
                try:
                    self.memberships[url] = await asyncio.to_thread(
                        self.join, self.dcs, engine_registration(entry, self.config.run_id))
                except DCSError as exc:
                    if exc.status != 409:
                        raise
                    self.pool.drain(url)  # removed between the listing and the registration

    def report(self) -> None:
        """Each kept registration heartbeats with the version its engine serves; an unreachable engine's lapses,
        so it drops out of the next weight sync."""
        for url, membership in self.memberships.items():
            if url in self.pool.urls:
                version, reachable = self.pool.version_of(url)
                membership.progress(weight_version=version)
                membership.suspended = not reachable

    def acknowledge_pause(self) -> None:
        for membership in self.memberships.values():
            membership.acknowledge_pause()

    async def close(self) -> None:
        for url in list(self.memberships):
            await asyncio.to_thread(self.memberships.pop(url).close)
