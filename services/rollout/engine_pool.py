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

    async def generate_batch(self, inputs: Sequence[Sequence[int]], sampling_params: Sequence[dict],
                             rids: Sequence[str] | None = None) -> list[Generation]: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


class Engines(Protocol):
    """What the rollout service uses of its engines (EnginePool)."""

    versions: list[int]
    reachable: list[bool]
    requests: int
    resubmits: int

    @property
    def serving_version(self) -> int: ...

    async def watch_versions(self, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None: ...

    async def generate_group(self, prompt_ids: Sequence[int], samplings: Sequence[dict], max_new_tokens: int,
                             rids: Sequence[str]) -> list[SampleOutput]: ...

    async def generate_samples(self, prompts: Sequence[Sequence[int]], samplings: Sequence[dict],
                               max_new_tokens: int, rids: Sequence[str]) -> list[SampleOutput]: ...

    async def aclose(self) -> None: ...


class EnginePool:
    def __init__(self, urls: Sequence[str], timeout_s: float = 600.0, api_key: str | None = None,
                 max_resubmits: int = 64, max_connect_retries: int = 30,
                 client: Callable[..., EngineClient] = SGLangClient):
        if not urls:
            raise ValueError("the rollout needs at least one engine URL")
        self.urls = list(urls)
        self.engines = [client(u, timeout_s=timeout_s, api_key=api_key) for u in self.urls]
        self.in_flight = [0] * len(self.engines)
        self._calls: list[set[asyncio.Future]] = [set() for _ in self.engines]  # generate calls in flight
        self.versions = [0] * len(self.engines)
        self.reachable = [True] * len(self.engines)
        self.newest = 0  # the newest version any engine has reported: an engine below it is stale
        self.max_resubmits = max_resubmits
        self.max_connect_retries = max_connect_retries
        self.requests = 0
        self.resubmits = 0

    @property
    def serving_version(self) -> int:
        """The version new requests begin under: only engines at the newest version get them (_pick)."""
        return self.newest

    async def watch_versions(self, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None:
        """Keep every engine's version current until cancelled, calling on_change when one moves. An engine
        that holds a long poll (the built-in engine) answers the moment its version moves; one that answers
        at once (SGLang) is asked again every poll_s."""
        await asyncio.gather(*(self._watch(i, wait_s, poll_s, on_change) for i in range(len(self.engines))))

    async def _watch(self, i: int, wait_s: float, poll_s: float, on_change: Callable[[], None]) -> None:
        seen: str | None = None
        while True:
            began = time.monotonic()
            try:
                raw = await self.engines[i].wait_weight_version(seen, wait_s)
                self.versions[i] = parse_version(raw)
                self.newest = max(self.newest, self.versions[i])
                self.reachable[i] = True
            except (httpx.HTTPError, SGLangError) as exc:
                if self.reachable[i]:
                    log.warning("engine unreachable: its requests go to another engine",
                                extra={"engine": self.urls[i], "error": str(exc), "requests": len(self._calls[i])})
                    self.reachable[i] = False
                    for call in self._calls[i]:
                        call.cancel()
                    on_change()
                await asyncio.sleep(poll_s)
                continue
            if raw != seen:
                seen = raw
                on_change()
            elif time.monotonic() - began < min(wait_s / 2, poll_s):  # no long poll there: poll
                await asyncio.sleep(poll_s)

    def _pick(self) -> int | None:
        """The least-loaded engine that is reachable and serves the newest weights seen; None if no
        engine does (one that restarted serves its initial weights until the trainer resends them)."""
        eligible = [i for i in range(len(self.engines)) if self.reachable[i] and self.versions[i] >= self.newest]
        return min(eligible, key=lambda i: self.in_flight[i]) if eligible else None

    async def generate(self, prompt_ids: Sequence[int], sampling: dict, max_new_tokens: int, rid: str) -> SampleOutput:
        return (await self.generate_group(prompt_ids, [sampling], max_new_tokens, [rid]))[0]

    async def generate_group(self, prompt_ids: Sequence[int], samplings: Sequence[dict], max_new_tokens: int,
                             rids: Sequence[str]) -> list[SampleOutput]:
        """The samples of one prompt (one sampling dict and rid each) in one request to one engine, which
        prefills the prompt once."""
        return await self.generate_samples([prompt_ids] * len(samplings), samplings, max_new_tokens, rids)

    async def generate_samples(self, prompts: Sequence[Sequence[int]], samplings: Sequence[dict],
                               max_new_tokens: int, rids: Sequence[str]) -> list[SampleOutput]:
        """One sample per prompt (with its sampling dict and rid) in one batch request to one engine, which
        prefills each distinct prompt once. Samples aborted by a weight update go back, together, as prompt +
        their partial output, until each has its tokens or a natural end."""
        samples = [SampleOutput() for _ in samplings]
        todo = list(range(len(samplings)))
        failures = 0
        while todo:
            i = self._pick()
            if i is None:
                await asyncio.sleep(0.2)
                continue
            self.in_flight[i] += len(todo)
            self.requests += 1
            call = asyncio.ensure_future(self.engines[i].generate_batch(
                [list(prompts[k]) + samples[k].output_ids for k in todo],
                [{**samplings[k], "max_new_tokens": max_new_tokens - len(samples[k].output_ids)} for k in todo],
                [rids[k] for k in todo]))
            self._calls[i].add(call)
            try:
                results = await call
            except (EngineUnreachable, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # this sample itself was cancelled, not the engine's call
                # engine restarting, unreachable, or stopped answering (_watch gave its calls up): try again,
                # elsewhere if another engine serves
                failures += 1
                if failures > self.max_connect_retries:
                    if isinstance(exc, EngineUnreachable):
                        raise
                    raise EngineUnreachable(self.urls[i], f"{failures} tries failed: {exc!r}") from exc
                log.warning("engine request failed; retrying", extra={"engine": self.urls[i], "error": repr(exc)})
                await asyncio.sleep(min(5.0, 0.2 * failures))
                continue
            finally:
                self._calls[i].discard(call)
                self.in_flight[i] -= len(todo)
            todo = [k for k, g in zip(todo, results) if self._absorb(samples[k], g, max_new_tokens, rids[k])]
        return samples

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
        for engine in self.engines:
            await engine.aclose()
            engine.close()
