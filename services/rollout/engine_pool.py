"""The rollout's engines: requests balanced across them (least in flight), their weight versions
watched (a long poll where the engine offers one), and partial rollout: a sample whose request was
aborted by a weight update (pause mode abort) is resubmitted as prompt + partial output under the new
weights, keeping the version spans of every part. An engine whose version long poll stops answering (a hung
or stopped process) gets no new requests, and the requests it holds are given up and sent to another engine
(the engine drops them itself once it sees their connections closed).

Two seams, so a role test runs the real pool against in-memory engines (tests/fakes/): the pool takes
`client`, what it makes each engine's client with (EngineClient: the SGLang protocol calls it uses), and the
rollout takes the pool itself as a factory (Engines: what the service uses of it)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import httpx

from services.rollout.admission import parse_version
from services.sglang_protocol.client import EngineUnreachable, Generation, SGLangClient, SGLangError
from services.sglang_protocol.lora_adapters import NamedAdapter, run_adapter

log = logging.getLogger(__name__)


@dataclass
class SampleOutput:
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end) over output ids
    finish_reason: str = "length"
    resubmits: int = 0

    @property
    def begin_version(self) -> int:
        return self.spans[0][0] if self.spans else 0

    def token_versions(self) -> list[int]:
        out: list[int] = []
        for version, start, end in self.spans:
            out.extend([version] * (end - start))
        return out

    def append(self, output_ids: Sequence[int], log_probs: Sequence[float], spans) -> None:
        base = len(self.output_ids)
        self.output_ids.extend(output_ids)
        self.log_probs.extend(log_probs)
        for version, start, end in spans:
            version = parse_version(version)
            if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == base + start:
                self.spans[-1] = (version, self.spans[-1][1], base + end)
            else:
                self.spans.append((version, base + start, base + end))


class EngineClient(Protocol):
    """What the pool uses of an engine's client (SGLangClient)."""

    async def wait_weight_version(self, newer_than: str | None, wait_s: float) -> str: ...

    async def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        sampling_params: Sequence[dict],
        rids: Sequence[str] | None = None,
        adapter: NamedAdapter | None = None,
    ) -> list[Generation]: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


class Engines(Protocol):
    """What the rollout service uses of its engines (EnginePool)."""

    requests: int
    resubmits: int
    adapters: str | None

    @property
    def serving_version(self) -> int: ...

    @property
    def urls(self) -> list[str]: ...

    def add(self, url: str) -> None: ...

    def hold(self, url: str, held: bool) -> None: ...

    def drain(self, url: str) -> None: ...

    def version_of(self, url: str) -> tuple[int | None, bool]: ...

    async def held_version(self, url: str) -> int | None: ...

    def describe(self) -> list[dict]: ...

    async def watch_versions(self, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None: ...

    async def generate(
        self, prompt_ids: Sequence[int], sampling: dict, max_new_tokens: int, rid: str
    ) -> SampleOutput: ...

    async def generate_group(
        self, prompt_ids: Sequence[int], samplings: Sequence[dict], max_new_tokens: int, rids: Sequence[str]
    ) -> list[SampleOutput]: ...

    async def generate_samples(
        self, prompts: Sequence[Sequence[int]], samplings: Sequence[dict], max_new_tokens: int, rids: Sequence[str]
    ) -> list[SampleOutput]: ...

    async def aclose(self) -> None: ...


@dataclass(eq=False)
class PooledEngine:
    """One engine of the pool and what the pool knows of it."""

    url: str
    client: EngineClient
    joined_at: int  # the newest version seen when it joined: it gets work only once it serves it
    version: int = 0
    known: bool = False  # it has reported a version since it joined
    reachable: bool = True
    draining: bool = False  # taken out of the run: no new requests; its own are resubmitted elsewhere
    held: bool = False  # not yet registered for the run's weight syncs (none would reach it): no requests
    in_flight: int = 0
    requests: int = 0
    first_version: int | None = None  # the version it served when given its first request
    calls: set = field(default_factory=set)  # its generate calls in flight
    watcher: asyncio.Task | None = None

    def state(self, newest: int) -> str:
        if self.draining:
            return "draining"
        if self.held:
            return "registering"
        if not self.reachable:
            return "unreachable"
        return "serving" if self.known and self.version >= newest else "waiting_for_weights"


class EnginePool:
    def __init__(
        self,
        urls: Sequence[str],
        timeout_s: float = 600.0,
        api_key: str | None = None,
        max_resubmits: int = 64,
        max_connect_retries: int = 30,
        client: Callable[..., EngineClient] = SGLangClient,
    ):
        """`urls`: the engines to start with (more join through `add`; none is fine when they are to come)."""
        self._client = lambda url: client(url, timeout_s=timeout_s, api_key=api_key)
        self.engines: dict[str, PooledEngine] = {}
        self.newest = 0  # the newest version any engine has reported: an engine below it is stale
        self.max_resubmits = max_resubmits
        self.max_connect_retries = max_connect_retries
        self.requests = 0
        self.resubmits = 0
        # a LoRA run's id: each request names the run's adapter of its engine's version (lora_adapters.py), which
        # an SGLang engine applies and a built-in engine has merged
        self.adapters: str | None = None
        self._watching: tuple[float, float, Callable[[], None]] | None = None
        for url in urls:
            self.add(url)

    @property
    def urls(self) -> list[str]:
        return list(self.engines)

    @property
    def versions(self) -> list[int]:
        return [e.version for e in self.engines.values()]

    @property
    def reachable(self) -> list[bool]:
        return [e.reachable for e in self.engines.values()]

    @property
    def in_flight(self) -> list[int]:
        return [e.in_flight for e in self.engines.values()]

    @property
    def serving_version(self) -> int:
        """The version new requests begin under: only engines at the newest version get them (_pick)."""
        return self.newest

    def version_of(self, url: str) -> tuple[int | None, bool]:
        """(the version `url` reported last, None before its first answer; whether it is reachable)."""
        engine = self.engines[url]
        return engine.version if engine.known else None, engine.reachable

    async def held_version(self, url: str) -> int | None:
        """The version `url` holds, asked of it now (its registration says it); None when it does not answer."""
        try:
            return parse_version(await self.engines[url].client.wait_weight_version(None, 0))
        except (httpx.HTTPError, SGLangError) as exc:
            log.info("engine not answering: registered once it does", extra={"engine": url, "error": str(exc)})
            return None

    def describe(self) -> list[dict]:
        """Each engine's state, for the rollout's /status and the live view."""
        return [
            {
                "url": e.url,
                "state": e.state(self.newest),
                "version": e.version,
                "in_flight": e.in_flight,
                "requests": e.requests,
                "joined_at_version": e.joined_at,
                "first_version": e.first_version,
            }
            for e in self.engines.values()
        ]

    def add(self, url: str) -> None:
        """A new engine: its version is watched at once, and it gets requests once it serves the newest."""
        if url in self.engines:
            return
        engine = self.engines[url] = PooledEngine(url, self._client(url), joined_at=self.newest)
        if self._watching is not None:
            engine.watcher = asyncio.ensure_future(self._watch(engine, *self._watching))
        log.info("engine joined", extra={"engine": url, "newest_version": self.newest})

    def hold(self, url: str, held: bool) -> None:
        """Hold `url` back from new requests (or let it have them): an engine that is not registered for the
        run's weight syncs would generate from weights no publish updates."""
        if url in self.engines:
            self.engines[url].held = held

    def drain(self, url: str) -> None:
        """Take `url` out: no new requests; the requests it holds are given up (the engine drops them when their
        connections close) and resubmitted to the others, so no sample is lost or generated twice."""
        engine = self.engines.pop(url, None)
        if engine is None:
            return
        engine.draining = True
        log.info("engine leaving: its requests go to the others", extra={"engine": url, "requests": len(engine.calls)})
        if engine.watcher is not None:
            engine.watcher.cancel()
        for call in engine.calls:
            call.cancel()
        asyncio.ensure_future(self._close_when_idle(engine))

    @staticmethod
    async def _close_when_idle(engine: PooledEngine) -> None:
        while engine.calls:
            await asyncio.sleep(0.05)
        await engine.client.aclose()
        engine.client.close()

    async def watch_versions(self, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None:
        """Keep every engine's version current until cancelled (engines added later too), calling on_change when
        one moves. An engine that holds a long poll (the built-in engine) answers the moment its version moves;
        one that answers at once (SGLang) is asked again every poll_s."""
        self._watching = (wait_s, poll_s, on_change)
        for engine in self.engines.values():
            if engine.watcher is None:
                engine.watcher = asyncio.ensure_future(self._watch(engine, wait_s, poll_s, on_change))
        try:
            while True:
                for engine in list(self.engines.values()):
                    if engine.watcher is not None and engine.watcher.done() and not engine.watcher.cancelled():
                        engine.watcher.result()  # it never ends on its own: surface its error
                await asyncio.sleep(1.0)
        finally:
            self._watching = None
            for engine in self.engines.values():
                if engine.watcher is not None:
                    engine.watcher.cancel()
                    engine.watcher = None

    async def _watch(self, engine: PooledEngine, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None:
        seen: str | None = None
        while True:
            began = time.monotonic()
            try:
                raw = await engine.client.wait_weight_version(seen, wait_s)
                engine.version, engine.known, engine.reachable = parse_version(raw), True, True
                self.newest = max(self.newest, engine.version)
            except (httpx.HTTPError, SGLangError) as exc:
                if engine.reachable:
                    log.warning(
                        "engine unreachable: its requests go to another engine",
                        extra={"engine": engine.url, "error": str(exc), "requests": len(engine.calls)},
                    )
                    engine.reachable = False
                    for call in engine.calls:
                        call.cancel()
                    on_change()
                await asyncio.sleep(poll_s)
                continue
            if raw != seen:
                seen = raw
                on_change()
            elif time.monotonic() - began < min(wait_s / 2, poll_s):  # no long poll there: poll
                await asyncio.sleep(poll_s)

    def _pick(self) -> PooledEngine | None:
        """The least-loaded engine that is reachable and serves the newest weights seen; None if no engine
        does (one that restarted, or just joined, serves older weights until the trainer sends it the newest).
        Before any version is known (the run's start) every reachable engine serves."""
        started = any(e.known for e in self.engines.values())
        eligible = [
            e
            for e in self.engines.values()
            if e.reachable and not e.draining and not e.held and e.version >= self.newest and (e.known or not started)
        ]
        return min(eligible, key=lambda e: e.in_flight) if eligible else None

    async def generate(self, prompt_ids: Sequence[int], sampling: dict, max_new_tokens: int, rid: str) -> SampleOutput:
        return (await self.generate_group(prompt_ids, [sampling], max_new_tokens, [rid]))[0]

    async def generate_group(
        self, prompt_ids: Sequence[int], samplings: Sequence[dict], max_new_tokens: int, rids: Sequence[str]
    ) -> list[SampleOutput]:
        """The samples of one prompt (one sampling dict and rid each) in one request to one engine, which
        prefills the prompt once."""
        return await self.generate_samples([prompt_ids] * len(samplings), samplings, max_new_tokens, rids)

    async def generate_samples(
        self, prompts: Sequence[Sequence[int]], samplings: Sequence[dict], max_new_tokens: int, rids: Sequence[str]
    ) -> list[SampleOutput]:
        """One sample per prompt (with its sampling dict and rid) in one batch request to one engine, which
        prefills each distinct prompt once. Samples aborted by a weight update go back, together, as prompt +
        their partial output, until each has its tokens or a natural end."""
        samples = [SampleOutput() for _ in samplings]
        todo = list(range(len(samplings)))
        failures = 0
        while todo:
            engine = self._pick()
            if engine is None:
                await asyncio.sleep(0.2)
                continue
            try:
                results = await self._call(
                    engine,
                    [list(prompts[k]) + samples[k].output_ids for k in todo],
                    [{**samplings[k], "max_new_tokens": max_new_tokens - len(samples[k].output_ids)} for k in todo],
                    [rids[k] for k in todo],
                )
            except (EngineUnreachable, asyncio.CancelledError) as exc:
                me = asyncio.current_task()
                assert me is not None  # a coroutine runs in a task
                if isinstance(exc, asyncio.CancelledError) and me.cancelling():
                    raise  # this sample itself was cancelled, not the engine's call
                # engine restarting, unreachable, stopped answering (_watch gave its calls up) or taken out of the
                # run (drain): try again, elsewhere if another engine serves
                failures += 1
                if failures > self.max_connect_retries:
                    if isinstance(exc, EngineUnreachable):
                        raise
                    raise EngineUnreachable(engine.url, f"{failures} tries failed: {exc!r}") from exc
                log.warning("engine request failed; retrying", extra={"engine": engine.url, "error": repr(exc)})
                await asyncio.sleep(0 if engine.draining else min(5.0, 0.2 * failures))
                continue
            todo = [k for k, g in zip(todo, results) if self._absorb(samples[k], g, max_new_tokens, rids[k])]
        return samples

    async def _call(self, engine: PooledEngine, inputs: list, samplings: list, rids: list) -> list[Generation]:
        engine.in_flight += len(inputs)
        engine.requests += 1
        self.requests += 1
        if engine.first_version is None:
            engine.first_version = engine.version
        named = {"adapter": run_adapter(self.adapters, engine.version)} if self.adapters and engine.version else {}
        call = asyncio.ensure_future(engine.client.generate_batch(inputs, samplings, rids, **named))
        engine.calls.add(call)
        try:
            return await call
        finally:
            engine.calls.discard(call)
            engine.in_flight -= len(inputs)

    def _absorb(self, sample: SampleOutput, g, max_new_tokens: int, rid: str) -> bool:
        """Add one response to its sample; True when it was cut short by an abort and must be resubmitted."""
        sample.append(g.output_ids, g.log_probs, g.spans)
        sample.finish_reason = g.finish_reason
        if g.finish_reason != "abort" or len(sample.output_ids) >= max_new_tokens:
            if sample.finish_reason == "abort":
                sample.finish_reason = "length"
            return False
        sample.resubmits += 1
        self.resubmits += 1
        if sample.resubmits > self.max_resubmits:
            raise RuntimeError(f"request {rid} was aborted {sample.resubmits} times")
        return True

    async def aclose(self) -> None:
        for engine in self.engines.values():
            if engine.watcher is not None:
                engine.watcher.cancel()
            await engine.client.aclose()
            engine.client.close()
