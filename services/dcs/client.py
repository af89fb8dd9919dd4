"""DCSClient: the only code that knows the coordinator's HTTP API."""

from __future__ import annotations

import httpx

from services.dcs.models import (
    Cursors, CursorUpdate, Heartbeat, HeartbeatReply, NodeInfo, NodeRegistration, PublishedWeights, Run,
    RunConfig, RunStatus, SyncGroup, SyncGroupRequest, SyncReport, Topology, WeightMetadata,
)


class DCSError(Exception):
    def __init__(self, status: int, detail):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class DCSClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0):
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, path: str, body=None, params=None, timeout=None):
        kwargs = {"params": params}
        if body is not None:
            kwargs["content"] = body.model_dump_json()
            kwargs["headers"] = {"content-type": "application/json"}
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise DCSError(response.status_code, detail)
        return response

    # ------------------------------------------------------------ nodes

    def register(self, registration: NodeRegistration) -> NodeInfo:
        return NodeInfo.model_validate_json(self._call("POST", "/v1/nodes", registration).content)

    def heartbeat(self, node_id: str, beat: Heartbeat) -> HeartbeatReply:
        return HeartbeatReply.model_validate_json(self._call("POST", f"/v1/nodes/{node_id}/heartbeat", beat).content)

    def unregister(self, node_id: str) -> bool:
        return self._call("DELETE", f"/v1/nodes/{node_id}").json()["ok"]

    def topology(self) -> Topology:
        return Topology.model_validate_json(self._call("GET", "/v1/topology").content)

    # ------------------------------------------------------------ weights

    def publish_weights(self, metadata: WeightMetadata) -> PublishedWeights:
        return PublishedWeights.model_validate_json(self._call("POST", "/v1/weights", metadata).content)

    def latest_weights(self) -> PublishedWeights:
        return PublishedWeights.model_validate_json(self._call("GET", "/v1/weights/latest").content)

    def weights(self, version: int) -> PublishedWeights:
        return PublishedWeights.model_validate_json(self._call("GET", f"/v1/weights/{version}").content)

    def next_weights(self, after: int, wait_s: float) -> PublishedWeights | None:
        """The newest version after `after`, waiting up to wait_s; None if none came."""
        response = self._call("GET", "/v1/weights/next", params={"after": after, "wait_s": wait_s},
                              timeout=wait_s + 10)
        if response.status_code == 204:
            return None
        return PublishedWeights.model_validate_json(response.content)

    def set_cursor(self, role: str, version: int) -> dict[str, int]:
        return Cursors.model_validate_json(
            self._call("PUT", f"/v1/weights/cursors/{role}", CursorUpdate(version=version)).content).cursors

    def cursors(self) -> dict[str, int]:
        return Cursors.model_validate_json(self._call("GET", "/v1/weights-cursors").content).cursors

    def cursors_of(self, role: str) -> int:
        return self.cursors().get(role, 0)

    # ------------------------------------------------------------ sync groups

    def sync_group(self, request: SyncGroupRequest) -> SyncGroup:
        return SyncGroup.model_validate_json(self._call("POST", "/v1/sync-groups", request).content)

    def current_group(self, run_id: str) -> SyncGroup:
        return SyncGroup.model_validate_json(self._call("GET", f"/v1/sync-groups/{run_id}").content)

    def report_sync(self, report: SyncReport) -> None:
        self._call("POST", "/v1/syncs", report)

    def sync_reports(self, limit: int = 50) -> list[SyncReport]:
        return [SyncReport.model_validate(r) for r in self._call("GET", "/v1/syncs", params={"limit": limit}).json()]

    # ------------------------------------------------------------ runs

    def create_run(self, config: RunConfig) -> Run:
        return Run.model_validate_json(self._call("POST", "/v1/runs", config).content)

    def run(self, run_id: str) -> Run:
        return Run.model_validate_json(self._call("GET", f"/v1/runs/{run_id}").content)

    def pause(self, run_id: str) -> Run:
        return Run.model_validate_json(self._call("POST", f"/v1/runs/{run_id}/pause").content)

    def resume(self, run_id: str) -> Run:
        return Run.model_validate_json(self._call("POST", f"/v1/runs/{run_id}/resume").content)

    def status(self, run_id: str) -> RunStatus:
        return RunStatus.model_validate_json(self._call("GET", f"/v1/runs/{run_id}/status").content)
