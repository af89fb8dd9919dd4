from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.run_contract.run_name import RunIdSettings
from services.runtime.auth_token import AuthTokenSettings
from services.runtime.tls import TLSSettings


class EngineConfig(AuthTokenSettings, TLSSettings, RunIdSettings):
    """`sluice engine`: the built-in rollout engine: a Hugging Face causal LM served over SGLang's
    HTTP protocol (generate, pause modes, distributed weight updates), continuous batching on CPU or
    one GPU."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_ENGINE_")

    model: str = Field(..., description="local Hugging Face model directory")
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(30000, description="HTTP port (also /metrics, with the token like every route)")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="a second port serving only /metrics, without "
        "the token (for Prometheus scrapes inside the cluster); 0 = off",
    )
    allow_unauthenticated_weight_updates: bool = Field(
        False,
        description=(
            "with no token configured, still accept the weight-update routes (anyone who reaches the port can then "
            "replace the model's weights); without it they answer 403 until a token is set"
        ),
    )
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$", description="weights dtype")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    max_running: int = Field(64, ge=1, description="most requests decoded together (KV slots in the pool)")
    context_length: int = Field(
        0,
        ge=0,
        description="longest prompt + output of one request; 0 = the model's max_position_embeddings, at most 4096",
    )
    max_total_tokens: int = Field(
        0,
        ge=0,
        description="KV pool size in tokens (slots = this // context "
        "length, at most max_running); 0 = max_running x context length",
    )
    mem_fraction_static: float = Field(
        0.88,
        gt=0,
        le=1,
        description="GPU only: fraction of the device's "
        "memory for the weights and the KV pool together (SGLang's flag); the pool "
        "holds no more tokens than what is left of it after the weights",
    )
    max_queued_requests: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="most samples waiting for a KV "
        "slot; a /generate that would queue more answers 503 (one asking for more "
        "samples than this alone: 400)",
    )
    max_new_tokens_limit: int = Field(
        0, ge=0, description="largest max_new_tokens a request may ask for (400 above it); 0 = the context length"
    )
    chunked_prefill_size: int = Field(
        2048, ge=1, description="prompt tokens prefilled per step, batched with the decode tokens"
    )
    speculative_algorithm: str = Field(
        "ngram",
        pattern="^(none|ngram)$",
        description="speculative decoding of "
        "greedy requests: ngram drafts from the request's own context (else other "
        "greedy requests'), verified in the step's forward (outputs unchanged); "
        "none = one token a step",
    )
    speculative_num_draft_tokens: int = Field(
        8,
        ge=1,
        le=64,
        description="most draft tokens per request and step (a step drafts at most max_running tokens in all)",
    )
    torch_threads: int = Field(
        1,
        ge=1,
        le=1024,
        description="intra-op threads of the forward; 1 suits a machine "
        "shared with other services (one thread each); an engine with cores to itself "
        "may use them all",
    )
    forward_workers: int = Field(
        1,
        ge=1,
        le=64,
        description="CPU only: cores a step's forward may use (on one "
        "thread, whole on that many intra-op threads, or split into sub-batches of its "
        "sequences, whichever is measured fastest for that kind of step); for an engine "
        "with that many cores to itself, 1 on a machine shared with other services",
    )
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="deadline of each weight broadcast")
    incremental_streaming_output: bool = Field(
        False,
        description=(
            "a streamed /generate event carries only the output ids new since the last (SGLang's flag); without it "
            "each event carries the ids so far, as SGLang's do by default"
        ),
    )
    dcs_url: str = Field(
        "",
        description="the coordinator to register with as one of the run's engines (it then "
        "gets the run's weights and requests without being listed in the rollout's --engine-url: "
        "scale engines up and down while the run goes on); empty = the rollout registers it",
    )
    advertise_host: str = Field(
        "127.0.0.1",
        description="with --dcs-url: the address the rollout and the trainer reach this engine at (a pod's IP)",
    )
    log_level: str = Field("info", description="debug|info|warning|error")

    @model_validator(mode="after")
    def _workers_on_cpu(self):
        if self.forward_workers > 1 and self.device != "cpu":
            raise ValueError("forward_workers > 1 splits a step over CPU threads; on a GPU leave it at 1")
        return self
