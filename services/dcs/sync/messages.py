"""The weight broadcast's wire messages: what a publisher sends the coordinator (the metadata of a version, the
group it asks for, its report) and what a receiver reads back. The coordinator's HTTP contract
(services/dcs/models.py) includes them; they live here so that the broadcast, and the engines and roles that
use it, need nothing of the coordinator's app or client."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TorchDType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
FloatDType = Literal["float32", "float16", "bfloat16", "float64"]
SyncBackend = Literal["gloo", "nccl", "ipc"]  # ipc: CUDA IPC handles over HTTP to engines on the source's GPU
MAX_VERSION = 1 << 62  # weight versions, steps and cursors: far past any run, and within Redis' int64
MAX_BYTES = 1 << 50


class Strict(BaseModel):
    # unknown keys are errors; so are NaN and Infinity, which Python's JSON parser reads
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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
        min_length=1, max_length=1 << 20, description="size of each flat bucket, in order"
    )
    publisher: str | None = None
    sync_group: "SyncGroup | None" = Field(None, description="the group this version is broadcast in")
    transfer: Literal["flat_buckets", "per_tensor", "cuda_ipc", "adapter_files"] = Field(
        "flat_buckets",
        description="one broadcast per bucket, one per tensor in list order (SGLang engines), "
        "buckets by CUDA IPC handle to engines on the trainer's GPU (no broadcast), or a "
        "LoRA adapter's files loaded by SGLang engines (no broadcast; only engines)",
    )

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


class SyncGroupRequest(Strict):
    source_node: str = Field(description="the trainer's node id: rank 0 and the only source")
    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    receiver_roles: list[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]] = Field(
        default_factory=lambda: ["engine", "actor_fwd", "reference"], max_length=16
    )
    backend: SyncBackend = "gloo"
    new_group: bool = Field(False, description="a new group even if membership is unchanged (the last sync failed)")
    exclude_nodes: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=1024,
        description="receivers to leave out although alive: engines the "
        "source found unresponsive (a failed sync, no /health answer since); they rejoin when they answer",
    )


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
    seconds: dict[
        Literal["metadata", "open_group", "pack", "broadcast", "engines", "engine_load", "load", "total"],
        Annotated[float, Field(ge=0, le=1e9)],
    ] = Field(default_factory=dict)
    bytes: int = Field(0, ge=0, le=MAX_BYTES)
    engines: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=1024,
        description=(
            "a publisher's ok report: the node ids of the engines that loaded `version` in this sync; the "
            "coordinator records it as the version each of them holds (GET /v1/runs/{run_id}/engines)"
        ),
    )
