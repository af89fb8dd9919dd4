"""The rollout's engines as the run's engine set on the coordinator says, followed while the run goes on:

    seed       the rollout's --engine-url list is added to the run's set (unless an engine was removed since)
    every poll the set, read again:
                 an engine new to it joins the pool (it gets requests once it serves the newest weights: the
                   trainer sends them to every engine the coordinator records with an older version)
                 an engine gone from it (removed over REST, or one that registered itself and stopped) is drained:
                   its requests are resubmitted to the others
                 an added engine (one that does not register itself: an SGLang server) is kept registered by
                   the rollout once it answers, the registration saying the version it holds (asked of it then);
                   the weight syncs that reach it record its later ones, so its heartbeats carry none. It drops
                   out of weight syncs while unreachable, and registers again when it reports an older version
                   than before (it restarted, with its initial weights)

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

    def acknowledge_pause(self) -> None: ...

    def close(self) -> None: ...


def engine_registration(entry: EngineEntry, run_id: str, version: int) -> NodeRegistration:
    url = httpx.URL(entry.url)
    # the port under its scheme: the trainer reaches an https engine over TLS
    return NodeRegistration(
        role="engine",
        rank=entry.rank,
        host=url.host,
        run_id=run_id,
        weight_version=version,
        ports={url.scheme: url.port or (443 if url.scheme == "https" else 80)},
    )


class EngineFleet:
    def __init__(
        self,
        config: RolloutConfig,
        pool: Engines,
        directory: EngineDirectory | None,
        join: Callable[..., EngineMembership],
        dcs=None,
    ):
        self.config = config
        self.pool = pool
        self.directory = directory
        self.join = join
        self.dcs = dcs
        self.memberships: dict[str, EngineMembership] = {}  # url -> the registration the rollout keeps
        self._listed: set[str] = set()  # every URL the run's set has held
        self._seen: dict[str, int] = {}  # url -> the newest version the pool saw its engine report while registered
        self._restarted: set[str] = set()  # urls whose engine reported an older version: to register again

    async def start(self) -> None:
        """Seed the run's set with the rollout's engines and take it in; without a coordinator, register the
        rollout's engines as they are (with register_engines)."""
        if self.directory is None:
            if self.config.register_engines:
                for rank, url in enumerate(self.config.engine_urls):
                    await self._keep_registered(EngineEntry(url=url, source="added", rank=rank))
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
            await self._unregister(url)
        for url, entry in wanted.items():
            self.pool.add(url)
            if entry.source == "added":
                await self._keep_registered(entry)
                # until registered (it did not answer yet), no publish reaches it: it generates nothing meanwhile
                self.pool.hold(url, url not in self.memberships)

    async def _keep_registered(self, entry: EngineEntry) -> None:
        """Register an added engine that has none (again, when it restarted) once it answers, with the version
        it holds now: what the coordinator records for it until a weight sync reaches it."""
        url = entry.url
        if url in self._restarted:
            await self._unregister(url)
        if url in self.memberships:
            return
        version = await self.pool.held_version(url)
        if version is None:  # not answering: the next poll tries again
            return
        try:
            self.memberships[url] = await asyncio.to_thread(
                self.join, self.dcs, engine_registration(entry, self.config.run_id, version)
            )
        except DCSError as exc:
            if exc.status != 409:
                raise
            self.pool.drain(url)  # removed between the listing and the registration

    async def _unregister(self, url: str) -> None:
        self._restarted.discard(url)
        self._seen.pop(url, None)
        membership = self.memberships.pop(url, None)
        if membership is not None:
            await asyncio.to_thread(membership.close)

    def report(self) -> None:
        """An unreachable engine's kept registration lapses, so it drops out of the next weight sync; one that
        reports an older version than before restarted (with its initial weights) and is registered again, saying
        so, at the next poll. Versions themselves are not reported: the weight syncs record them."""
        for url, membership in self.memberships.items():
            if url in self.pool.urls:
                version, reachable = self.pool.version_of(url)
                membership.suspended = not reachable
                if version is None:
                    continue
                if version < self._seen.get(url, 0) and url not in self._restarted:
                    log.warning(
                        "engine restarted: it registers again with its initial weights",
                        extra={"engine": url, "version": version, "was": self._seen[url]},
                    )
                    self._restarted.add(url)
                self._seen[url] = max(version, self._seen.get(url, 0))

    def acknowledge_pause(self) -> None:
        for membership in self.memberships.values():
            membership.acknowledge_pause()

    async def close(self) -> None:
        for url in list(self.memberships):
            await self._unregister(url)
