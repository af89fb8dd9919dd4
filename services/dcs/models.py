"""The coordinator's HTTP contract: every request and response body is one of these models, and the
OpenAPI document generated from them (/openapi.json) is the contract other languages use."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.run_contract.run_config import RunConfig

Name = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
TorchDType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
FloatDType = Literal["float32", "float16", "bfloat16", "float64"]
SyncBackend = Literal["gloo", "nccl", "ipc"]  # ipc: CUDA IPC handles over HTTP to engines on the source's GPU
NodeState = Literal["running", "pausing", "paused", "dead"]
RunLifecycle = Literal["running", "paused", "failed", "finished", "stopped"]
ENDED = frozenset({"failed", "finished", "stopped"})  # terminal: no transition leaves them
MAX_FAILURE_MESSAGE = 4096


MAX_VERSION = 1 << 62  # weight versions, steps and cursors: far past any run, and within Redis' int64
MAX_BYTES = 1 << 50


class Strict(BaseModel):
    # unknown keys are errors; so are NaN and Infinity, which Python's JSON parser reads
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ------------------------------------------------------------------ nodes


class NodeRegistration(Strict):
    role: str = Field(pattern=r"^[a-z_]{1,32}$", description="trainer, rollout, engine, actor_fwd, reference, ...")
    rank: int = Field(0, ge=0, le=1 << 20)
    host: str = Field(min_length=1, max_length=253)
    ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=dict, max_length=16, description="named ports, e.g. {'http': 30000}")
    device: str = Field("cpu", max_length=64)
    parallel: dict[str, Annotated[int, Field(ge=1, le=1 << 20)]] = Field(
        default_factory=dict, max_length=16, description="layout, e.g. {'tp': 2, 'pp': 1, 'dp': 4}")
    master_port: int | None = Field(None, ge=1, le=65535, description="a free port it can host a sync group on")
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    weights_dtype: FloatDType | None = Field(None, description=(
        "a weight receiver's: the dtype it serves its weights in (a publish sends floating tensors in it)"))
    gpu: str | None = Field(None, max_length=128, description=(
        "the UUID of the GPU it computes on (none on a CPU): a publish picks its transfer by who shares a GPU"))

    def url(self) -> str | None:
        """Its base URL (an engine's, a role's status server): its 'https' port (TLS) if it registered one, else
        its 'http' port; None with neither."""
        for scheme in ("https", "http"):
            if (port := self.ports.get(scheme)) is not None:
                return f"{scheme}://{self.host}:{port}"
        return None


class NodeInfo(NodeRegistration):
    node_id: str
    registered_at: float
    last_heartbeat: float
    alive: bool
    step: int | None = None
    weight_version: int | None = None
    paused_seq: int = 0
    error: str | None = None


class Heartbeat(Strict):
    step: int | None = Field(None, ge=0, le=MAX_VERSION)
    weight_version: int | None = Field(None, ge=0, le=MAX_VERSION)
    paused_seq: int = Field(0, ge=0, le=MAX_VERSION, description="the pause request it has reached a safe point for (0 = none)")
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
    if not parts.hostname or parts.username or parts.password or parts.path not in ("", "/") or parts.query \
            or parts.fragment:
        raise ValueError(f"engine URL {url!r}: only scheme://host[:port] (no path, query or credentials)")
    return f"{parts.scheme}://{parts.hostname}:{port}"


class EngineAdd(Strict):
    """POST /v1/runs/{run_id}/engines: an engine the run should use (an SGLang server, or a built-in engine that
    does not register itself); the rollout keeps it registered and sends it requests once it serves the
    run's current weights."""

    url: str = Field(min_length=1, max_length=512, description="its base URL, http(s)://host:port")
    initial: bool = Field(False, description=(
        "one of the rollout's own --engine-url list: not added again when it was removed from the run"))

    @field_validator("url")
    @classmethod
    def _canonical(cls, url: str) -> str:
        return engine_url(url)


class EngineEntry(Strict):
    url: str = Field(description="scheme://host:port")
    source: Literal["added", "self"] = Field(description=(
        "added: through POST /v1/runs/{run_id}/engines (or the rollout's --engine-url), kept registered by the "
        "rollout; self: a built-in engine that registered itself (--dcs-url), gone when its lease lapses"))
    rank: int = Field(description="its place in the run's engine list (stable while it stays in it)")
    node_id: str | None = Field(None, description="its registration, once made")
    alive: bool = Field(False, description="its registration is alive (heartbeats within the lease)")
    weight_version: int | None = Field(None, description="the weight version it last reported")


class EngineList(Strict):
    engines: list[EngineEntry]
    removed: list[str] = Field(default_factory=list, description=(
        "URLs taken out of the run: they cannot register for it again until added again"))


# ------------------------------------------------------------------ weights


class WeightTensor(Strict):
    name: str = Field(min_length=1, max_length=512, description="Hugging Face parameter name")
    dtype: TorchDType
    shape: list[Annotated[int, Field(ge=0, le=MAX_BYTES)]] = Field(max_length=16)
    bucket: int = Field(ge=0, le=1 << 20)
    offset: int = Field(ge=0, le=MAX_BYTES, description="byte offset inside its bucket")
    nbytes: int = Field(ge=0, le=MAX_BYTES)


class WeightMetadata(Strict):
    version: int = Field(ge=1, le=MAX_VERSION)
    tensors: list[WeightTensor] = Field(min_length=1, max_length=1 << 20)
    bucket_bytes: list[Annotated[int, Field(ge=0, le=MAX_BYTES)]] = Field(
        min_length=1, max_length=1 << 20, description="size of each flat bucket, in order")
    publisher: str | None = None
    sync_group: "SyncGroup | None" = Field(None, description="the group this version is broadcast in")
    transfer: Literal["flat_buckets", "per_tensor", "cuda_ipc"] = Field(
        "flat_buckets", description="one broadcast per bucket, one per tensor in list order (SGLang engines), or "
                                    "buckets by CUDA IPC handle to engines on the trainer's GPU (no broadcast)")

    @model_validator(mode="after")
    def _layout_fits(self) -> "WeightMetadata":
        for t in self.tensors:
            if t.bucket >= len(self.bucket_bytes):
                raise ValueError(f"tensor {t.name} names bucket {t.bucket}; there are {len(self.bucket_bytes)}")
            if t.offset + t.nbytes > self.bucket_bytes[t.bucket]:
                raise ValueError(f"tensor {t.name} overruns bucket {t.bucket}")
            if any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name} has a negative dimension")
        return self


class PublishedWeights(WeightMetadata):
    published_at: float


class CursorUpdate(Strict):
    version: int = Field(ge=0, le=MAX_VERSION)


class Cursors(Strict):
    cursors: dict[str, int]


# ------------------------------------------------------------------ sync groups


class SyncGroupRequest(Strict):
    source_node: str = Field(description="the trainer's node id: rank 0 and the only source")
    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    receiver_roles: list[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]] = Field(
        default_factory=lambda: ["engine", "actor_fwd", "reference"], max_length=16)
    backend: SyncBackend = "gloo"
    new_group: bool = Field(False, description="a new group even if membership is unchanged (the last sync failed)")
    exclude_nodes: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=1024, description="receivers to leave out although alive: engines the "
        "source found unresponsive (a failed sync, no /health answer since); they rejoin when they answer")


class GroupMember(Strict):
    node_id: str
    role: str
    rank: int = Field(description="its first rank (SGLang's rank_offset)")
    ranks: int = Field(1, description="ranks it occupies (an engine's tensor-parallel size)")
    weights_dtype: FloatDType | None = Field(None, description="the dtype it declared it serves its weights in")
    gpu: str | None = Field(None, description="the UUID of its GPU, if it registered one")


class SyncGroup(Strict):
    name: str
    generation: int
    master_address: str
    master_port: int
    world_size: int
    backend: SyncBackend
    members: list[GroupMember]


class SyncReport(Strict):
    version: int = Field(ge=1, le=MAX_VERSION)
    group: str = Field(max_length=128)
    node_id: str = Field(max_length=64)
    ok: bool
    error: str | None = Field(None, max_length=4096)
    seconds: dict[Literal["metadata", "open_group", "pack", "broadcast", "engines", "engine_load", "load", "total"],
                  Annotated[float, Field(ge=0, le=1e9)]] = Field(default_factory=dict)
    bytes: int = Field(0, ge=0, le=MAX_BYTES)


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
    later_failures: list[Failure] = Field(default_factory=list,
                                          description="failures reported after the first (the newest 10)")
    latest_weight_version: int
    services: list[ServiceStatus]


class StepRecord(Strict):
    step: int = Field(ge=0)
    metrics: dict[str, Any] = Field(description="the trainer's metrics of the step (reward_mean, loss, ...)")


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
