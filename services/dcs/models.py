"""The coordinator's HTTP contract: every request and response body is one of these models, and the
OpenAPI document generated from them (/openapi.json) is the contract other languages use."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from services.dcs.sync.messages import (  # the weight broadcast's messages are part of this contract
    MAX_BYTES as MAX_BYTES,
    MAX_VERSION as MAX_VERSION,
    FloatDType as FloatDType,
    GroupMember as GroupMember,
    PublishedWeights as PublishedWeights,
    Strict as Strict,
    SyncBackend as SyncBackend,
    SyncGroup as SyncGroup,
    SyncGroupRequest as SyncGroupRequest,
    SyncReport as SyncReport,
    TorchDType as TorchDType,
    WeightMetadata as WeightMetadata,
    WeightTensor as WeightTensor,
)
from services.run_contract.run_config import RunConfig

Name = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
NodeState = Literal["running", "pausing", "paused", "dead"]
RunLifecycle = Literal["running", "paused", "failed", "finished", "stopped"]
ENDED = frozenset({"failed", "finished", "stopped"})  # terminal: no transition leaves them
MAX_FAILURE_MESSAGE = 4096


# ------------------------------------------------------------------ nodes


class NodeRegistration(Strict):
    role: str = Field(pattern=r"^[a-z_]{1,32}$", description="trainer, rollout, engine, actor_fwd, reference, ...")
    rank: int = Field(0, ge=0, le=1 << 20)
    host: str = Field(min_length=1, max_length=253)
    ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=dict, max_length=16, description="named ports, e.g. {'http': 30000}"
    )
    device: str = Field("cpu", max_length=64)
    parallel: dict[str, Annotated[int, Field(ge=1, le=1 << 20)]] = Field(
        default_factory=dict, max_length=16, description="layout, e.g. {'tp': 2, 'pp': 1, 'dp': 4}"
    )
    master_port: int | None = Field(None, ge=1, le=65535, description="a free port it can host a sync group on")
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    weights_dtype: FloatDType | None = Field(
        None,
        description=(
            "a weight receiver's: the dtype it serves its weights in (a publish sends floating tensors in it)"
        ),
    )
    gpu: str | None = Field(
        None,
        max_length=128,
        description=(
            "the UUID of the GPU it computes on (none on a CPU): a publish picks its transfer by who shares a GPU"
        ),
    )
    weight_version: int | None = Field(
        None,
        ge=0,
        le=MAX_VERSION,
        description=(
            "an engine's only: the weight version it holds as it registers (0: the weights it started with); "
            "from then on the coordinator records the version of each weight sync that reached it (SyncReport.engines)"
        ),
    )

    @model_validator(mode="after")
    def _engine_version_only(self) -> "NodeRegistration":
        if self.weight_version is not None and self.role != "engine":
            raise ValueError("weight_version is registered by engines only; other nodes report theirs by heartbeat")
        return self

    def url(self) -> str | None:
        """Its base URL (an engine's, a role's status server): its 'https' port (TLS) if it registered one, else
        its 'http' port; None with neither."""
        for scheme in ("https", "http"):
            if (port := self.ports.get(scheme)) is not None:
                return f"{scheme}://{url_host(self.host)}:{port}"
        return None


class NodeInfo(NodeRegistration):
    node_id: str
    registered_at: float
    last_heartbeat: float
    alive: bool
    step: int | None = None
    weight_version: int | None = Field(
        None,
        description=(
            "an engine: the version it holds, as it registered and then as each weight sync that reached it reported "
            "(null: it said none); another node: the version its last heartbeat reported"
        ),
    )
    paused_seq: int = 0
    error: str | None = None

    @model_validator(mode="after")
    def _engine_version_only(self) -> "NodeInfo":  # replaces the registration's check: any node has a version here
        return self


class Heartbeat(Strict):
    step: int | None = Field(None, ge=0, le=MAX_VERSION)
    weight_version: int | None = Field(
        None,
        ge=0,
        le=MAX_VERSION,
        description=(
            "the version the node holds (a forward role's receiver); not an engine's, which the coordinator records "
            "from its registration and the weight syncs (409)"
        ),
    )
    paused_seq: int = Field(
        0, ge=0, le=MAX_VERSION, description="the pause request it has reached a safe point for (0 = none)"
    )
    error: str | None = Field(None, max_length=4096)


class HeartbeatReply(Strict):
    desired_state: Literal["running", "paused"]
    pause_seq: int
    lease_s: float
    status: RunLifecycle = Field("running", description="the run's lifecycle status; failed or stopped: exit")


class Topology(Strict):
    roles: dict[str, list[NodeInfo]]


def engine_url(url: str) -> str:
    """An engine's base URL in the one form the coordinator compares: `scheme://host:port` (the port under its
    scheme's default when left out, the host lower-cased, no path, query or credentials)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URL {url!r}: the scheme must be http or https")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"engine URL {url!r}: {exc}") from None
    if (
        not parts.hostname
        or parts.username
        or parts.password
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"engine URL {url!r}: only scheme://host[:port] (no path, query or credentials)")
    return f"{parts.scheme}://{url_host(parts.hostname)}:{port}"


def url_host(host: str) -> str:
    """A host as a URL writes it: an IPv6 address in brackets (`[::1]`), a name or IPv4 address as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class EngineAdd(Strict):
    """POST /v1/runs/{run_id}/engines: an engine the run should use (an SGLang server, or a built-in engine that
    does not register itself); the rollout keeps it registered and sends it requests once it serves the
    run's current weights."""

    url: str = Field(min_length=1, max_length=512, description="its base URL, http(s)://host:port")
    initial: bool = Field(
        False,
        description=("one of the rollout's own --engine-url list: not added again when it was removed from the run"),
    )

    @field_validator("url")
    @classmethod
    def _canonical(cls, url: str) -> str:
        return engine_url(url)


class EngineEntry(Strict):
    url: str = Field(description="scheme://host:port")
    source: Literal["added", "self"] = Field(
        description=(
            "added: through POST /v1/runs/{run_id}/engines (or the rollout's --engine-url), kept registered by the "
            "rollout; self: a built-in engine that registered itself (--dcs-url), gone when its lease lapses"
        )
    )
    rank: int = Field(description="its place in the run's engine list (stable while it stays in it)")
    node_id: str | None = Field(None, description="its registration, once made")
    alive: bool = Field(False, description="its registration is alive (heartbeats within the lease)")
    weight_version: int | None = Field(
        None,
        description=(
            "the weight version it holds: said at its registration, then recorded from each weight sync that reached it"
        ),
    )


class EngineList(Strict):
    engines: list[EngineEntry]
    removed: list[str] = Field(
        default_factory=list,
        description=("URLs taken out of the run: they cannot register for it again until added again"),
    )


# ------------------------------------------------------------------ weights


class CursorUpdate(Strict):
    version: int = Field(ge=0, le=MAX_VERSION)


class Cursors(Strict):
    cursors: dict[str, int]


# ------------------------------------------------------------------ runs


class FailureReport(Strict):
    """A role's fatal error, reported before it exits non-zero."""

    role: str = Field(pattern=r"^[a-z_]{1,32}$", description="the role that failed (trainer, rollout, ...)")
    node_id: str | None = Field(None, max_length=64, description="its node id, if it had registered")
    message: str = Field(min_length=1, max_length=MAX_FAILURE_MESSAGE, description="what went wrong")


class Failure(FailureReport):
    at: float = Field(description="when the coordinator recorded it (epoch seconds, Redis clock)")


class Run(Strict):
    """A run and its lifecycle. `status`: running -> paused -> running (pause/resume); running or paused ->
    failed (a role's first failure), finished (the trainer trained num_steps) or stopped (operator); those
    three are terminal. `desired_state` is the pause request the roles follow, as before."""

    run_id: str
    config: RunConfig
    desired_state: Literal["running", "paused"]
    pause_seq: int
    created_at: float
    status: RunLifecycle = Field("running", description="running | paused | failed | finished | stopped")
    failure: Failure | None = Field(None, description="the first failure reported (status failed)")
    ended_at: float | None = Field(None, description="when it became failed, finished or stopped")


class ServiceStatus(Strict):
    node_id: str
    role: str
    rank: int
    state: NodeState
    step: int | None
    weight_version: int | None
    last_heartbeat: float
    pause_acknowledged: bool
    url: str | None = Field(None, description="where it is reached (an engine's base URL, a role's status server)")


class RunStatus(Strict):
    run: Run
    status: RunLifecycle = Field(description="the run's lifecycle status (= run.status)")
    failure: Failure | None = Field(None, description="the first failure reported (= run.failure)")
    later_failures: list[Failure] = Field(
        default_factory=list, description="failures reported after the first (the newest 10)"
    )
    latest_weight_version: int
    services: list[ServiceStatus]


MAX_STEPS_PER_REPORT = 1000


class StepRecord(Strict):
    step: int = Field(ge=0, le=MAX_VERSION)
    metrics: dict[str, Any] = Field(
        max_length=4096, description="the trainer's metrics of the step (reward_mean, loss, ...)"
    )


class StepsReport(Strict):
    """POST /v1/runs/{run_id}/steps: the trainer's progress and the records of the steps it finished since its
    last acknowledged report (a step reported again replaces its record)."""

    next_step: int = Field(ge=0, le=MAX_VERSION, description="the step the trainer trains next (= steps finished)")
    weight_version: int = Field(ge=0, le=MAX_VERSION, description="the weight version it trains that step with")
    steps: list[StepRecord] = Field(default_factory=list, max_length=MAX_STEPS_PER_REPORT)

    @model_validator(mode="after")
    def _finished_steps_only(self) -> StepsReport:
        unfinished = [r.step for r in self.steps if r.step >= self.next_step]
        if unfinished:
            raise ValueError(f"steps {unfinished[:5]} are not finished: next_step is {self.next_step}")
        return self


class StepsPage(Strict):
    """GET /v1/runs/{run_id}/steps: the trainer's progress and its recorded steps' metrics."""

    next_step: int = Field(description="the step the trainer trains next (= steps finished)")
    weight_version: int = Field(description="the weight version it trains that step with")
    steps: list[StepRecord] = Field(description="recorded steps from `first` on, in order")


class Ok(Strict):
    ok: bool = True
    message: str = ""


WeightMetadata.model_rebuild()
PublishedWeights.model_rebuild()
