from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineConfig(BaseSettings):
    """`sluice engine`: the built-in rollout engine: a Hugging Face causal LM served over SGLang's
    HTTP protocol (generate, pause modes, distributed weight updates), continuous batching on CPU or
    one GPU."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_ENGINE_")

    model: str = Field(..., description="local Hugging Face model directory")
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(30000, description="HTTP port (also /metrics)")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$", description="weights dtype")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    max_running: int = Field(64, ge=1, description="most requests decoded together (KV slots in the pool)")
    context_length: int = Field(0, ge=0, description="longest prompt + output of one request; 0 = the "
                                "model's max_position_embeddings, at most 4096")
    max_total_tokens: int = Field(0, ge=0, description="KV pool size in tokens (slots = this // context "
                                  "length, at most max_running); 0 = max_running x context length")
    chunked_prefill_size: int = Field(2048, ge=1, description="prompt tokens prefilled per step, batched "
                                      "with the decode tokens")
    speculative_algorithm: str = Field("ngram", pattern="^(none|ngram)$", description="speculative decoding of "
                                       "greedy requests: ngram drafts from the request's own context, verified "
                                       "in the step's forward (outputs unchanged); none = one token a step")
    speculative_num_draft_tokens: int = Field(8, ge=1, le=64, description="most draft tokens per request and "
                                              "step (a step drafts at most max_running tokens in all)")
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="deadline of each weight broadcast")
    log_level: str = Field("info", description="debug|info|warning|error")
