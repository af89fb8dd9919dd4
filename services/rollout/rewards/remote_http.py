"""A reward computed by a remote HTTP endpoint (a sandbox that runs code, a judge model, ...).

    POST <url>   {"prompt": str | [messages], "response": str, "fields": {...}}
    200          {"reward": number}

Each attempt has `timeout_s` in all (connect to last byte). Connection errors, timeouts and 5xx are
retried up to `retries` more times with exponential backoff (retries.py, the policy of every remote reward).
A 4xx is the request's fault, so it is not retried: RewardError at once, with the status and the start of
the body. One httpx.AsyncClient (one connection pool) serves every call."""

from __future__ import annotations

import json

import httpx

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.retries import Transient, check_limits, with_retries
from services.rollout.rewards.reward_function import RewardFunction, finite_reward


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class RemoteReward(RewardFunction):
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        token: str | None = None,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        max_connections: int = 64,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward endpoint must be an http:// or https:// URL, got {url!r}")
        check_limits(timeout_s, retries)
        self.name = url
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            headers=headers, timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections)
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def score(self, record: PromptRecord, response: str) -> float:
        try:
            body = json.dumps({"prompt": record.prompt, "response": response, "fields": record.fields}, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RewardError(
                f"reward endpoint {self.url}: the row at position {record.position} cannot be sent as JSON: {e}"
            ) from e
        reply = await with_retries(
            lambda: self._attempt(body),
            f"reward endpoint {self.url}",
            timeout_s=self.timeout_s,
            retries=self.retries,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
        )
        return self._reward(reply)

    async def _attempt(self, body: str) -> httpx.Response:
        try:
            reply = await self._http.post(self.url, content=body)
        except httpx.TimeoutException:
            raise TimeoutError from None
        except httpx.TransportError as e:
            raise Transient(f"{type(e).__name__}: {e}") from e
        if reply.status_code >= 500:
            raise Transient(f"HTTP {reply.status_code}: {_excerpt(reply.text)}")
        if not 200 <= reply.status_code < 300:
            raise RewardError(
                f"reward endpoint {self.url} refused the request: HTTP {reply.status_code}: {_excerpt(reply.text)}"
            )
        return reply

    def _reward(self, reply: httpx.Response) -> float:
        try:
            data = reply.json()
        except ValueError:
            raise RewardError(f"reward endpoint {self.url} answered non-JSON: {_excerpt(reply.text)}") from None
        if not isinstance(data, dict) or "reward" not in data:
            raise RewardError(
                f'reward endpoint {self.url} answered {_excerpt(reply.text)}, expected {{"reward": number}}'
            )
        if isinstance(data["reward"], bool):  # JSON true/false are not numbers
            raise RewardError(f"reward endpoint {self.url} answered reward {data['reward']!r}, expected a number")
        return finite_reward(data["reward"], f"reward endpoint {self.url}")
