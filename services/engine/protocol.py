"""The engine's HTTP request and response bodies: SGLang's names and shapes (docs/engine.md), typed, so
FastAPI validates them and the OpenAPI document describes them. A body that does not fit gets 400 with a
message naming the field (server.py turns FastAPI's 422 into SGLang's 400)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.dcs.sync.cuda_ipc import SharedBucket
from services.engine.sampling import SamplingParams


NonNegative = Annotated[int, Field(ge=0)]
FromMinusOne = Annotated[int, Field(ge=-1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateRequest(BaseModel):
    """One input (`text` a string or `input_ids` a list of ints: the answer is one object) or a batch
    (lists of either: a list of answers). `sampling_params` and `rid` are one for all inputs or one each.
    Unknown top-level keys are ignored, as SGLang's server ignores them (clients such as slime and AReaL send
    keys of their own); SGLang's inputs this engine cannot serve (images, video, audio, embeddings, a LoRA
    adapter, a custom logit processor) are refused when set."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = Field(False, description="one for all inputs or one each")
    top_logprobs_num: NonNegative | list[NonNegative] | None = Field(
        0, description="top log-probs per output token (with return_logprob); one for all inputs or one each"
    )
    logprob_start_len: FromMinusOne | list[FromMinusOne] | None = Field(
        -1, description="prompt log-probs from this position; -1 = none; one for all inputs or one each"
    )
    stream: bool = Field(False, description="server-sent events, each with the new output ids")
    image_data: None = Field(None, description="SGLang's: only null (the engine serves text models)")
    video_data: None = None
    audio_data: None = None
    input_embeds: None = None
    lora_path: None = Field(None, description="SGLang's: only null (no LoRA adapters)")
    custom_logit_processor: None = None

    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        ids = self.input_ids
        return ids is not None and len(ids) > 0 and isinstance(ids[0], int)


class MetaInfo(BaseModel):
    id: str
    finish_reason: dict | None = Field(None, description='{"type": "stop" | "length" | "abort", ...}')
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[dict] | None = Field(
        None, description="(version, start, end) spans over the output ids, when the request crossed an update"
    )
    output_token_logprobs: list[list] | None = Field(None, description="[logprob, token id, null] per output token")
    output_top_logprobs: list[list[list]] | None = None
    input_token_logprobs: list[list] | None = None


class GenerateResult(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = Field(None, description="streaming only: which sample this event belongs to")


class AbortRequest(_Body):
    rid: str | None = Field(None, description="abort every request whose rid starts with this")
    abort_all: bool = False


class PauseRequest(_Body):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class InitGroupRequest(_Body):
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this engine's rank in the group (rank 0 is the trainer)")
    world_size: int = Field(ge=2, le=65536)
    group_name: str = Field("weight_update_group", min_length=1, max_length=200)
    backend: Literal["gloo", "nccl"] = "gloo"  # (ipc syncs form no group: /update_weights_from_tensor)


class DestroyGroupRequest(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang's /update_weights_from_disk (AReaL's disk mode): the weights of a model directory on this
    engine's machine, safetensors only."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = Field(None, max_length=128)
    flush_cache: bool = True


class UpdateWeightVersionRequest(_Body):
    """SGLang's /update_weight_version: the version the engine reports from now on."""

    new_version: str = Field(min_length=1, max_length=128)
    abort_all_requests: bool = False


class FlatBucket(_Body):
    """Sluice's extension: the bucket's tensors arrive as one uint8 broadcast at these byte offsets."""

    offsets: list[int]
    nbytes: int = Field(ge=0)


class UpdateWeightsRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None
    flat_bucket: FlatBucket | None = None
    lora_scaling: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description=("Sluice: the tensors are a LoRA adapter (peft's names), merged as W0 + lora_scaling * B @ A"),
    )


class IpcBucket(_Body):
    """Sluice's form of /update_weights_from_tensor (load_format "sluice_cuda_ipc"): one flat bucket on the
    trainer's GPU, shared by CUDA IPC handle in JSON (services/dcs/sync/cuda_ipc.py), and its tensors' layout."""

    shared: SharedBucket
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]


class UpdateWeightsFromTensorRequest(_Body):
    serialized_named_tensors: list[str] | None = Field(
        None, description=("SGLang's pickled tensors: refused (the engine never unpickles request data); send `bucket`")
    )
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    bucket: IpcBucket | None = None
    lora_scaling: float | None = Field(None, gt=0, le=1e6, description="Sluice: as /update_weights_from_distributed's")


class ControlResult(BaseModel):
    success: bool
    message: str


class WeightVersion(BaseModel):
    weight_version: str


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool
    weight_version: str
    live_weight_update: bool = Field(description="Sluice: updates load between steps; no pause is needed")
    flat_bucket_update: bool = Field(description="Sluice: /update_weights_from_distributed takes flat_bucket")
    weights_dtype: str = Field(
        description="Sluice: the dtype the weights are served in; a trainer sends floating "
        "weights in it (others are cast on load)"
    )
    gpu: str | None = Field(description="Sluice: the UUID of the engine's GPU (none on a CPU)")
    cuda_ipc_update: bool = Field(description="Sluice: /update_weights_from_tensor takes a bucket by CUDA IPC handle")
    lora_adapter_update: bool = Field(
        False,
        description=(
            "Sluice: an update may be a LoRA adapter (peft's names, with lora_scaling), merged into the base weights"
        ),
    )


class ServerInfo(BaseModel):
    """SGLang's /server_info (/get_server_info): its server arguments; the fields the built-in engine has."""

    model_path: str
    dtype: str
    device: str
    tp_size: int
    mem_fraction_static: float
    max_running_requests: int
    context_length: int
    chunked_prefill_size: int
    speculative_algorithm: str | None
    weight_version: str
    version: str = Field(description="the server's version (sluice-<package version>)")
