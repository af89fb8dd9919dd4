"""What a run is: the configuration every role reads from the coordinator (`GET /v1/runs/{id}`), so
rollout, forward, advantage and trainer agree on batch sizes, staleness and the algorithm.

Submitted once (`POST /v1/runs`) and validated here; services only read it. Role-local, operational settings (addresses, ports, checkpoint directory) are each
service's own flags."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.algorithms.names import Estimator, KLKind, LossAggregation



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutSettings(_Strict):
    prompts: str = Field("demo:letters", min_length=1, max_length=1024,
                         description="a .jsonl or .parquet file, or demo:<task>")
    prompt_field: str = Field("prompt", min_length=1, max_length=128)
    shuffle_seed: int | None = Field(None, description="shuffle each epoch with this seed; None = file order")
    reward: str | None = Field(None, max_length=1024, description=(
        "exact_match | math_answer | arith | letters | import:module:function | http(s)://url; "
        "None = the demo task's own verifier"))
    label_field: str = Field("label", min_length=1, max_length=128)
    reward_timeout_s: float = Field(30.0, gt=0)
    reward_retries: int = Field(3, ge=0, le=20)
    apply_chat_template: bool = Field(True, description="wrap text prompts as one user message")
    max_new_tokens: int = Field(64, ge=1, le=1 << 20)
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_groups_in_flight: int = Field(0, ge=0, description="cap on prompt groups generating at once; 0 = 2 steps' worth")


class AlgorithmSettings(_Strict):
    estimator: Estimator = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    kl_coef: float = Field(0.0, ge=0, description="weight of KL(pi || reference); 0 = no reference role")
    kl_in_reward: bool = Field(False, description="KL as a per-token reward penalty instead of a loss term")
    kl_kind: KLKind = "k3"
    eps_clip: float = Field(0.2, gt=0, lt=1)
    eps_clip_high: float | None = Field(None, gt=0, description="upper clip (DAPO clip-higher); None = eps_clip")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages")
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: LossAggregation = "token_mean"
    decoupled: bool = Field(False, description="decoupled PPO: actor_fwd's log_probs are the proximal policy")
    tis_clip: float | None = Field(None, gt=0, description="truncated importance sampling cap vs rollout log-probs")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value-loss clip (critic)")


class OptimSettings(_Strict):
    lr: float = Field(1e-6, gt=0)
    critic_lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0


class RunConfig(_Strict):
    """What a run is; validated when it is created."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    model: str = Field(min_length=1, max_length=1024, description="local model directory")
    mode: Literal["fully_async", "colocate"] = "fully_async"
    max_staleness: int = Field(1, ge=0, le=64)
    n_samples_per_prompt: int = Field(8, ge=1, le=4096)
    rollout_batch_size: int = Field(32, ge=1, description="prompt groups per step")
    global_batch_size: int = Field(256, ge=1, description="samples per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward pass")
    num_iters_per_train_update: int | None = Field(
        None, ge=1, description="optimizer steps per step (= per weight publish); "
                                "None = rollout_batch_size * n_samples_per_prompt / global_batch_size")
    num_steps: int = Field(100, ge=1)
    ref_update_interval: int = Field(0, ge=0, description="reference receives every Nth version; 0 = never")
    checkpoint_interval: int = Field(0, ge=0, description="trainer checkpoints every N steps; 0 = never")
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)

    @model_validator(mode="before")
    @classmethod
    def _colocate_is_on_policy(cls, data):
        if isinstance(data, dict) and data.get("mode") == "colocate" and "max_staleness" not in data:
            data = {**data, "max_staleness": 0}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.mode == "colocate" and self.max_staleness != 0:
            raise ValueError("colocate mode is synchronous: max_staleness must be 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        if self.global_batch_size % self.n_samples_per_prompt:
            raise ValueError("global_batch_size must hold whole prompt groups (a multiple of n_samples_per_prompt)")
        rows = self.rows_per_step
        iters = self.num_iters_per_train_update or max(1, rows // self.global_batch_size)
        if iters * self.global_batch_size != rows:
            raise ValueError(f"a step holds rollout_batch_size * n_samples_per_prompt = {rows} samples, which must "
                             f"equal num_iters_per_train_update ({iters}) x global_batch_size "
                             f"({self.global_batch_size})")
        self.num_iters_per_train_update = iters
        return self

    @property
    def rows_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def uses_reference(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.estimator == "ppo"

    @property
    def uses_actor_fwd(self) -> bool:
        # decoupled PPO and truncated IS both need the trainer-side old policy's log-probs
        return self.algorithm.decoupled or self.algorithm.tis_clip is not None
