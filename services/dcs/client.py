"""AsyncDCSClient and its blocking facade DCSClient: the only code that knows the coordinator's HTTP API."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from services.dcs.models import (
    MAX_FAILURE_MESSAGE,
    Cursors,
    CursorUpdate,
    EngineAdd,
    EngineEntry,
    EngineList,
    FailureReport,
    Heartbeat,
    HeartbeatReply,
    NodeInfo,
    NodeRegistration,
    Ok,
    PublishedWeights,
    Run,
    RunConfig,
    RunStatus,
    StepsPage,
    StepsReport,
    SyncGroup,
    SyncGroupRequest,
    SyncReport,
    Topology,
    WeightMetadata,
)
from services.runtime.loop_thread import BlockingFacade, blocking_methods
from services.runtime.tls import client_ssl_context


class DCSError(Exception):
    def __init__(self, status: int, detail):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class DCSUnreachable(OSError):
    """The coordinator could not be reached or did not answer in time (an OSError: callers that wait for
    a coordinator to come up retry OSErrors)."""


@dataclass
class _Answer:
    status_code: int
    content: bytes

    def json(self):
        return json.loads(self.content)


class AsyncDCSClient:
    """The coordinator's client (asyncio); DCSClient below is its blocking facade. aiohttp, not httpx: in a
    profile of a running trainer, httpx's request path was 30% of the trainer's Python time (four to five
    coordinator calls per published version)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.token = token  # the stack's one token: also what its users send to the engines
        # https: the server is verified (services/runtime/tls.py); None = aiohttp's default for http
        self._ssl = client_ssl_context() if self.base_url.startswith("https://") else None
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None  # made on first use, on the loop that uses it

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, method: str, path: str, body=None, params=None, timeout=None) -> _Answer:
        headers = {"content-type": "application/json"} if body is not None else None
        data = body.model_dump_json() if body is not None else None
        params = {k: str(v) for k, v in params.items()} if params else None
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl or True)
            )
        try:
            async with self._http.request(
                method,
                self.base_url + path,
                data=data,
                headers=headers,
                params=params,
                timeout=aiohttp.ClientTimeout(total=timeout or self._timeout_s),
            ) as r:
                answer = _Answer(r.status, await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise DCSUnreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if answer.status_code >= 400:
            try:
                detail = answer.json().get("detail")
            except (ValueError, AttributeError):
                detail = answer.content.decode(errors="replace")[:500]
            raise DCSError(answer.status_code, detail)
        return answer

    # ------------------------------------------------------------ nodes

    async def register(self, registration: NodeRegistration) -> NodeInfo:
        return NodeInfo.model_validate_json((await self._call("POST", "/v1/nodes", registration)).content)

    async def heartbeat(self, node_id: str, beat: Heartbeat) -> HeartbeatReply:
        response = await self._call("POST", f"/v1/nodes/{node_id}/heartbeat", beat)
        return HeartbeatReply.model_validate_json(response.content)

    async def unregister(self, node_id: str) -> bool:
        return (await self._call("DELETE", f"/v1/nodes/{node_id}")).json()["ok"]

    async def topology(self) -> Topology:
        return Topology.model_validate_json((await self._call("GET", "/v1/topology")).content)

    # ------------------------------------------------------------ weights (per run)

    async def publish_weights(self, run_id: str, metadata: WeightMetadata) -> PublishedWeights:
        response = await self._call("POST", f"/v1/runs/{run_id}/weights", metadata)
        return PublishedWeights.model_validate_json(response.content)

    async def latest_weights(self, run_id: str) -> PublishedWeights:
        response = await self._call("GET", f"/v1/runs/{run_id}/weights/latest")
        return PublishedWeights.model_validate_json(response.content)

    async def weights(self, run_id: str, version: int) -> PublishedWeights:
        response = await self._call("GET", f"/v1/runs/{run_id}/weights/{version}")
        return PublishedWeights.model_validate_json(response.content)

    async def next_weights(self, run_id: str, after: int, wait_s: float) -> PublishedWeights | None:
        """The run's newest version after `after`, waiting up to wait_s; None if none came."""
        response = await self._call(
            "GET", f"/v1/runs/{run_id}/weights/next", params={"after": after, "wait_s": wait_s}, timeout=wait_s + 10
        )
        if response.status_code == 204:
            return None
        return PublishedWeights.model_validate_json(response.content)

    async def set_cursor(self, run_id: str, role: str, version: int) -> dict[str, int]:
        response = await self._call("PUT", f"/v1/runs/{run_id}/cursors/{role}", CursorUpdate(version=version))
        return Cursors.model_validate_json(response.content).cursors

    async def cursors(self, run_id: str) -> dict[str, int]:
        return Cursors.model_validate_json((await self._call("GET", f"/v1/runs/{run_id}/cursors")).content).cursors

    async def cursors_of(self, run_id: str, role: str) -> int:
        return (await self.cursors(run_id)).get(role, 0)

    # ------------------------------------------------------------ sync groups (per run)

    async def sync_group(self, run_id: str, request: SyncGroupRequest) -> SyncGroup:
        response = await self._call("POST", f"/v1/runs/{run_id}/sync-group", request)
        return SyncGroup.model_validate_json(response.content)

    async def current_group(self, run_id: str) -> SyncGroup:
        return SyncGroup.model_validate_json((await self._call("GET", f"/v1/runs/{run_id}/sync-group")).content)

    async def report_sync(self, run_id: str, report: SyncReport) -> None:
        await self._call("POST", f"/v1/runs/{run_id}/syncs", report)

    async def sync_reports(self, run_id: str, limit: int = 50) -> list[SyncReport]:
        response = await self._call("GET", f"/v1/runs/{run_id}/syncs", params={"limit": limit})
        return [SyncReport.model_validate(r) for r in response.json()]

    # ------------------------------------------------------------ runs

    async def create_run(self, config: RunConfig) -> Run:
        return Run.model_validate_json((await self._call("POST", "/v1/runs", config)).content)

    async def run(self, run_id: str) -> Run:
        return Run.model_validate_json((await self._call("GET", f"/v1/runs/{run_id}")).content)

    async def pause(self, run_id: str) -> Run:
        return Run.model_validate_json((await self._call("POST", f"/v1/runs/{run_id}/pause")).content)

    async def resume(self, run_id: str) -> Run:
        return Run.model_validate_json((await self._call("POST", f"/v1/runs/{run_id}/resume")).content)

    async def fail_run(self, run_id: str, role: str, message: str, node_id: str | None = None) -> Run:
        """Report a fatal error of `role` (the run becomes failed unless it already ended or failed).
        A message over the coordinator's bound is cut, keeping its end (where a traceback names the cause)."""
        if len(message) > MAX_FAILURE_MESSAGE:
            message = "..." + message[-(MAX_FAILURE_MESSAGE - 3) :]
        report = FailureReport(role=role, node_id=node_id, message=message or "failed")
        return Run.model_validate_json((await self._call("POST", f"/v1/runs/{run_id}/fail", report)).content)

    async def stop_run(self, run_id: str) -> Run:
        """Every role of the run exits at its next safe point; the run's status becomes stopped."""
        return Run.model_validate_json((await self._call("POST", f"/v1/runs/{run_id}/stop")).content)

    async def delete_run(self, run_id: str) -> str:
        """Forget an ended run and all state kept for it (409 while it runs: stop it first)."""
        return Ok.model_validate_json((await self._call("DELETE", f"/v1/runs/{run_id}")).content).message

    async def finish_run(self, run_id: str) -> Run:
        """The trainer trained num_steps: the run's status becomes finished."""
        return Run.model_validate_json((await self._call("POST", f"/v1/runs/{run_id}/finish")).content)

    async def status(self, run_id: str) -> RunStatus:
        return RunStatus.model_validate_json((await self._call("GET", f"/v1/runs/{run_id}/status")).content)

    async def engines(self, run_id: str) -> EngineList:
        """The run's engines (added ones and those that registered themselves)."""
        return EngineList.model_validate_json((await self._call("GET", f"/v1/runs/{run_id}/engines")).content)

    async def add_engine(self, run_id: str, url: str, initial: bool = False) -> EngineEntry:
        response = await self._call("POST", f"/v1/runs/{run_id}/engines", EngineAdd(url=url, initial=initial))
        return EngineEntry.model_validate_json(response.content)

    async def remove_engine(self, run_id: str, url: str) -> str:
        return (await self._call("DELETE", f"/v1/runs/{run_id}/engines", params={"url": url})).json()["message"]

    async def report_steps(self, run_id: str, report: StepsReport) -> None:
        """The trainer's progress and the records of the steps it finished since its last acknowledged report
        (services/trainer/step_reports.py sends them)."""
        await self._call("POST", f"/v1/runs/{run_id}/steps", report)

    async def steps(self, run_id: str, first: int = 0, limit: int = 100) -> StepsPage:
        """The trainer's progress and the metrics of its reported steps from `first` on."""
        response = await self._call("GET", f"/v1/runs/{run_id}/steps", params={"first": first, "limit": limit})
        return StepsPage.model_validate_json(response.content)


@blocking_methods(AsyncDCSClient)
class DCSClient(BlockingFacade[AsyncDCSClient]):
    """The blocking client: AsyncDCSClient's calls, run on a private event-loop thread."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0):
        super().__init__(AsyncDCSClient(base_url, token, timeout_s), "dcs-client")
        self.token = token
