"""In-memory engines for the rollout's real EnginePool (its `client` seam, services/rollout/engine_pool.py:
EngineClient). Every engine of the fleet serves the fleet's weight version, which the test moves as the trainer's
publish would; a version long poll answers the moment it moves. Generation is deterministic, so a test can say
what every sample must hold:

    sample with sampling_seed s: length(s) = 3 + s % 4 tokens (finish "stop"; "length" when max_new_tokens cuts it)
    response token j:            token(s, j) = 4 + (31 * s + 7 * j) % 1000   (never a special token)
    its log-prob:                log_prob(version, j) = -(j + 1) / 10 - version

`abort_next(n)`: the next request is cut after n tokens of each sample by a weight update to version + 1 (pause
mode abort); the pool resubmits prompt + partial output, which continues the same samples under the new version.
`stop(url)`: that engine hangs, as a process stopped with SIGSTOP does: its requests never answer and its version
long poll times out (httpx.ReadTimeout, after the poll's wait). `lag(url, v)`: that engine serves version v (one
that joined and has not been sent the newest weights yet) until `catch_up(url)`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from typing import Sequence

from services.sglang_protocol.client import Generation


def sample_length(seed: int) -> int:
    return 3 + seed % 4


def token(seed: int, j: int) -> int:
    return 4 + (31 * seed + 7 * j) % 1000


def log_prob(version: int, j: int) -> float:
    return -(j + 1) / 10 - version


@dataclass
class Request:
    url: str
    rids: list[str]
    inputs: list[list[int]]
    version: int  # the fleet's version when the request reached the engine


class FakeEngines:
    def __init__(self):
        self.version = 0
        self.requests: list[Request] = []
        self.clients: list[FakeEngineClient] = []
        self._abort_at: int | None = None
        self._prompt_length: dict[str, int] = {}  # rid -> the prompt's length (its first request's input)
        self._moved: asyncio.Event | None = None
        self.stopped: set[str] = set()
        self.hung: list[Request] = []  # requests a stopped engine took and never answered
        self.lagging: dict[str, int] = {}  # url -> the older version it serves

    def client(self, url: str, timeout_s: float = 60.0, api_key: str | None = None) -> "FakeEngineClient":
        """Made as SGLangClient is: the pool's `client` seam."""
        self.clients.append(FakeEngineClient(self, url))
        return self.clients[-1]

    def set_version(self, version: int) -> None:
        self.version = version
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    def stop(self, url: str) -> None:
        self.stopped.add(url)

    def lag(self, url: str, version: int) -> None:
        self.lagging[url] = version

    def catch_up(self, url: str) -> None:
        self.lagging.pop(url, None)
        self.set_version(self.version)  # its long poll answers with the fleet's version

    def serves(self, url: str) -> int:
        return self.lagging.get(url, self.version)

    def abort_next(self, after_tokens: int) -> None:
        self._abort_at = after_tokens

    def first_requests(self) -> dict[str, Request]:
        """rid -> the request its sample began in."""
        out: dict[str, Request] = {}
        for request in self.requests:
            for rid in request.rids:
                out.setdefault(rid, request)
        return out

    async def _wait_moved(self, url: str, seen: str, wait_s: float) -> None:
        if str(self.serves(url)) != seen:
            return
        if self._moved is None:
            self._moved = asyncio.Event()
        try:
            await asyncio.wait_for(self._moved.wait(), wait_s)
        except asyncio.TimeoutError:
            pass

    def _sample(self, input_ids: Sequence[int], sampling: dict, rid: str, cut: int | None) -> Generation:
        start = len(input_ids) - self._prompt_length.setdefault(rid, len(input_ids))  # tokens it already has
        seed, budget = sampling["sampling_seed"], sampling["max_new_tokens"]
        end = min(sample_length(seed), start + budget)
        reason = "stop" if end == sample_length(seed) else "length"
        if cut is not None and start + cut < end:
            end, reason = start + cut, "abort"
        ids = [token(seed, j) for j in range(start, end)]
        return Generation(
            ids, [log_prob(self.version, j) for j in range(start, end)], reason, [(str(self.version), 0, len(ids))]
        )

    async def generate(self, url: str, inputs, sampling_params, rids) -> list[Generation]:
        if url in self.stopped:
            self.hung.append(Request(url, list(rids), [list(x) for x in inputs], self.version))
            await asyncio.Event().wait()  # never answers; a caller can only give up (cancel)
        self.requests.append(Request(url, list(rids), [list(x) for x in inputs], self.serves(url)))
        await asyncio.sleep(0)  # in flight: other groups' requests go out meanwhile
        await asyncio.sleep(0)
        cut, self._abort_at = self._abort_at, None
        out = [self._sample(x, s, rid, cut) for x, s, rid in zip(inputs, sampling_params, rids)]
        if cut is not None:
            self.set_version(self.version + 1)  # the update that aborted them is loaded
        return out


class FakeEngineClient:
    def __init__(self, fleet: FakeEngines, url: str):
        self.fleet = fleet
        self.url = url
        self.closed = False

    async def wait_weight_version(self, newer_than: str | None, wait_s: float) -> str:
        if self.url in self.fleet.stopped:
            await asyncio.sleep(wait_s)
            raise httpx.ReadTimeout(f"{self.url} did not answer")
        if newer_than is not None and wait_s > 0:
            await self.fleet._wait_moved(self.url, newer_than, wait_s)
        return str(self.fleet.serves(self.url))

    async def generate_batch(
        self, inputs: Sequence[Sequence[int]], sampling_params: Sequence[dict], rids: Sequence[str] | None = None
    ) -> list[Generation]:
        return await self.fleet.generate(self.url, inputs, sampling_params, rids)

    async def aclose(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
