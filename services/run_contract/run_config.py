"""What a run is: the configuration every role reads from the coordinator (`GET /v1/runs/{id}`), so
rollout, forward, advantage and trainer agree on batch sizes, staleness and the algorithm.

Submitted once (`POST /v1/runs`) and validated here; services only read it. Role-local, operational settings (addresses, ports, checkpoint directory) are each
service's own flags. The longer sections are modules of their own beside this one: rollout_settings.py
(`rollout:`, `reward_shaping:`) and trainer_settings.py (`trainer:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from services.algorithms.names import Estimator, KLKind, LossAggregation
from services.run_contract.config_section import BIG, SEED_MAX, ConfigSection
from services.run_contract.rollout_settings import RewardShaping, RolloutSettings
from services.run_contract.trainer_settings import TrainerSettings


class AlgorithmSettings(ConfigSection):
    estimator: Estimator = Field(
        "grpo", description="advantage estimator (docs/algorithms.md); ppo adds the critic role"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount of returns (reinforce_pp, ppo)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo)")
    kl_coef: float = Field(0.0, ge=0, le=1e6, description="weight of KL(pi || reference); 0 = no reference role")
    kl_in_reward: bool = Field(False, description="KL as a per-token reward penalty instead of a loss term")
    kl_kind: KLKind = Field(
        "k3", description="KL estimator: k1 = x, k2 = x^2 / 2, k3 = exp(-x) - 1 + x, x = log pi - log pi_ref"
    )
    eps_clip: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip: ratio in [1 - eps_clip, 1 + eps_clip]")
    eps_clip_high: float | None = Field(
        None, gt=0, le=100, description="upper clip (DAPO clip-higher); None = eps_clip"
    )
    dual_clip_c: float | None = Field(None, gt=1, le=1e6, description="dual-clip bound for negative advantages")
    entropy_coef: float = Field(0.0, ge=0, le=1e6, description="weight of the entropy bonus in the loss")
    loss_agg: LossAggregation = Field(
        "token_mean",
        description=(
            "how per-token losses are averaged: token_mean (over all tokens), seq_mean_token_mean (per sequence, "
            "then over sequences), seq_mean_token_sum (summed per sequence, mean over sequences)"
        ),
    )
    decoupled: bool = Field(False, description="decoupled PPO: actor_fwd's log_probs are the proximal policy")
    tis_clip: float | None = Field(
        None, gt=0, le=1e6, description="truncated importance sampling cap vs rollout log-probs"
    )
    behav_weight_cap: float | None = Field(
        5.0,
        gt=1,
        le=1e6,
        description=(
            "with decoupled or tis_clip: tokens whose behaviour weight pi_old / mu exceeds this leave the policy loss "
            "(AReaL's behav_imp_weight_cap, 5 in its recipes); None = keep every token"
        ),
    )
    behav_weight_floor: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=(
            "with decoupled or tis_clip: tokens whose behaviour weight is below this leave the policy loss too"
        ),
    )
    proximal_policy: Literal["previous", "current"] = Field(
        "previous",
        description=(
            "with decoupled or tis_clip, the weights actor_fwd scores step N's samples with (pi_old, the clip's centre): "
            "previous = the version before the one step N trains with, so the clip bounds how far each step moves the "
            "policy; current = the version step N trains with (its ratio is 1 at a step's one optimizer step, and the "
            "clip bounds nothing)"
        ),
    )
    value_clip: float | None = Field(0.2, gt=0, le=1e6, description="PPO value-loss clip (critic)")


class OptimSettings(ConfigSection):
    lr: float = Field(1e-6, gt=0, le=10, description="actor learning rate (AdamW)")
    critic_lr: float = Field(1e-5, gt=0, le=10, description="critic learning rate (AdamW, ppo)")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="clip the gradient's global norm to this")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="seed of the trainer's random state")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="learning rate over the run's steps after the warm-up: constant, or decaying to "
        "min_lr_ratio x lr at the last step, linearly or along a half cosine",
    )
    warmup_steps: int = Field(
        0, ge=0, le=BIG, description="steps over which the learning rate rises linearly from lr / warmup_steps to lr"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="where linear and cosine decay end, as a fraction of lr")

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimSettings":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must each be in [0, 1), got {list(self.betas)}")
        return self


class CheckpointSettings(ConfigSection):
    """Trainer checkpoints (docs/services.md, "Checkpoints"): written under the trainer's --checkpoint-dir, each a
    Hugging Face model directory with the run's tokenizer and chat template (`sluice export` makes a plain one)."""

    interval: int = Field(0, ge=0, le=BIG, description="checkpoint every N steps; 0 = only on stop (see on_stop)")
    keep_last: int = Field(2, ge=1, le=1000, description="newest checkpoints kept per role; older ones are deleted")
    on_stop: bool = Field(
        True,
        description="when the actor trainer stops (SIGTERM, a stopped run, the last step "
        "done), checkpoint its last finished step if it has none yet",
    )

    def due_after(self, step: int) -> bool:
        """Whether step N's checkpoint is written once it trains: every `interval` steps (N + 1 a multiple)."""
        return bool(self.interval) and (step + 1) % self.interval == 0


class TrackingSettings(ConfigSection):
    """Experiment tracking by the trainer (docs/tracking.md): every step's metrics go to each backend of
    `report_to` and to <run dir>/steps.jsonl (the input of `sluice report`)."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        default_factory=lambda: ["tensorboard"],  # type: ignore[arg-type]  # the lambda's list[str]
        max_length=3,
        description="tracking backends: tensorboard (event files), wandb (offline run), mlflow (local SQLite "
        "store), all under the run dir; none = only steps.jsonl",
    )
    completions_every: int = Field(
        10, ge=0, le=BIG, description="log a table of sample completions every N steps; 0 = never"
    )
    completions_rows: int = Field(8, ge=1, le=256, description="samples in each completions table")
    project: str = Field("sluice", min_length=1, max_length=128, description="W&B project / MLflow experiment")
    experiment: str | None = Field(
        None, max_length=128, description="name of this run in the backends; None = the run's name"
    )

    @model_validator(mode="after")
    def _report_to_is_a_set(self) -> "TrackingSettings":
        if len(set(self.report_to)) != len(self.report_to) or ("none" in self.report_to and len(self.report_to) > 1):
            raise ValueError(f"tracking.report_to: each backend at most once, and none alone; got {self.report_to}")
        return self


class EvalSettings(ConfigSection):
    """Evaluation during training (docs/rewards.md, "Evaluation"): the rollout scores a held-out prompt set with
    the run's reward at version 0, whenever the engines' weight version reaches a multiple of every_n_versions,
    and at the last version. pass@k (k = n_samples) is the fraction of prompts with at least one of k samples
    whose reward >= pass_threshold; mean_reward the mean over all samples."""

    prompts: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description=(
            "held-out prompts: a .jsonl or .parquet file, or demo:<task> (rows the training never sees); None = no eval"
        ),
    )
    every_n_versions: int = Field(
        10, ge=1, le=BIG, description="evaluate when the weight version reaches a multiple of this"
    )
    n_samples: int = Field(1, ge=1, le=256, description="samples per prompt: the k of pass@k")
    temperature: float = Field(0.0, ge=0, le=10, description="sampling temperature; 0 = greedy (reproducible)")
    max_new_tokens: int | None = Field(None, ge=1, le=1 << 20, description="None = rollout.max_new_tokens")
    max_prompts: int = Field(64, ge=1, le=100_000, description="the first max_prompts rows of the held-out set")
    pass_threshold: float = Field(1.0, allow_inf_nan=False, description="a sample passes when its reward is >= this")
    concurrency: int = Field(
        32,
        ge=1,
        le=1024,
        description=(
            "eval prompts generating at once, sent as one batch request: the engine decodes them in the same steps "
            "as training requests (one wide step costs little more than a narrow one on a small batch)"
        ),
    )

    @model_validator(mode="after")
    def _prompt_source_form(self) -> "EvalSettings":
        p = self.prompts
        if p is not None and not (p.startswith("demo:") or p.lower().endswith((".jsonl", ".parquet"))):
            raise ValueError(f"eval.prompts must be a .jsonl or .parquet file or demo:<task>, got {p!r}")
        return self


class RunConfig(ConfigSection):
    """What a run is; validated when it is created."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.\-]{1,128}$", description="the run's id: every service of the run works under it"
    )
    model: str = Field(min_length=1, max_length=1024, description="local model directory")
    mode: Literal["fully_async", "colocate"] = Field(
        "fully_async",
        description=(
            "fully_async: rollout runs ahead of training by up to max_staleness versions; colocate: one after the "
            "other (max_staleness 0)"
        ),
    )
    max_staleness: int = Field(
        1, ge=0, le=64, description="most weight versions a trained sample may lag the policy it is trained with"
    )
    n_samples_per_prompt: int = Field(8, ge=1, le=4096, description="samples per prompt (the group size)")
    rollout_batch_size: int = Field(32, ge=1, le=1 << 20, description="prompt groups per step")
    global_batch_size: int = Field(256, ge=1, le=1 << 24, description="samples per optimizer step")
    micro_batch_size: int = Field(8, ge=1, le=1 << 20, description="samples per forward/backward pass")
    num_iters_per_train_update: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="optimizer steps per step (= per weight publish); "
        "None = rollout_batch_size * n_samples_per_prompt / global_batch_size",
    )
    num_steps: int = Field(100, ge=1, le=BIG, description="training steps (= weight versions published)")
    ref_update_interval: int = Field(0, ge=0, le=BIG, description="reference receives every Nth version; 0 = never")
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings, description="trainer checkpoints: interval, keep_last, on_stop"
    )
    algorithm: AlgorithmSettings = Field(
        default_factory=AlgorithmSettings, description="advantage estimator and loss terms (docs/algorithms.md)"
    )
    rollout: RolloutSettings = Field(
        default_factory=RolloutSettings, description="prompts, sampling and rewards (docs/rewards.md)"
    )
    optim: OptimSettings = Field(default_factory=OptimSettings, description="the optimizers (AdamW)")
    tracking: TrackingSettings = Field(
        default_factory=TrackingSettings, description="experiment tracking by the trainer (docs/tracking.md)"
    )
    eval: EvalSettings = Field(
        default_factory=EvalSettings,
        description="evaluation on held-out prompts during training; off unless eval.prompts is set",
    )
    reward_shaping: RewardShaping = Field(
        default_factory=RewardShaping,
        description=(
            "what happens to answers cut off at max_new_tokens (docs/rewards.md); applied to single completions"
        ),
    )
    trainer: TrainerSettings = Field(
        default_factory=TrainerSettings,
        description=("what the actor trains: every weight, or a LoRA adapter (docs/trainer.md)"),
    )

    @model_validator(mode="before")
    @classmethod
    def _colocate_is_on_policy(cls, data):
        if isinstance(data, dict) and data.get("mode") == "colocate" and "max_staleness" not in data:
            data = {**data, "max_staleness": 0}
        return data

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_interval_alias(cls, data):
        """`checkpoint_interval: N` (the older spelling) is `checkpoint: {interval: N}`."""
        if isinstance(data, dict) and "checkpoint_interval" in data:
            data = dict(data)
            interval = data.pop("checkpoint_interval")
            checkpoint = data.get("checkpoint")
            checkpoint = checkpoint.model_dump() if isinstance(checkpoint, BaseModel) else dict(checkpoint or {})
            if "interval" in checkpoint and checkpoint["interval"] != interval:
                raise ValueError("checkpoint_interval and checkpoint.interval disagree; give only checkpoint.interval")
            data["checkpoint"] = {**checkpoint, "interval": interval}
        return data

    @property
    def checkpoint_interval(self) -> int:
        return self.checkpoint.interval

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.mode == "colocate" and self.max_staleness != 0:
            raise ValueError("colocate mode is synchronous: max_staleness must be 0")
        overlong = self.reward_shaping.overlong
        if overlong is not None and overlong.buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward_shaping.overlong.buffer ({overlong.buffer}) must be at most rollout."
                f"max_new_tokens ({self.rollout.max_new_tokens})"
            )
        if self.trainer.lora is not None and (self.uses_actor_fwd or self.ref_update_interval):
            raise ValueError(
                "trainer.lora publishes an adapter, which only the engines take: actor_fwd "
                "(algorithm.decoupled, tis_clip) and a reference updated by ref_update_interval would "
                "need full weights; turn those off or train every weight"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        if self.global_batch_size % self.group_rows:
            raise ValueError(
                f"global_batch_size must hold whole prompt groups (a multiple of n_samples_per_prompt"
                f"{' x rollout.agent_chains' if self.chains_per_episode > 1 else ''} = {self.group_rows})"
            )
        rows = self.rows_per_step
        iters = self.num_iters_per_train_update or max(1, rows // self.global_batch_size)
        if iters * self.global_batch_size != rows:
            raise ValueError(
                f"a step holds rollout_batch_size * n_samples_per_prompt"
                f"{' * rollout.agent_chains' if self.chains_per_episode > 1 else ''} = {rows} samples, "
                f"which must equal num_iters_per_train_update ({iters}) x global_batch_size "
                f"({self.global_batch_size})"
            )
        self.num_iters_per_train_update = iters
        return self

    @property
    def chains_per_episode(self) -> int:
        """Samples (rows) each of a group's n samples is written as: an agent episode's chains, else 1."""
        return self.rollout.agent_chains if self.rollout.agent else 1

    @property
    def group_rows(self) -> int:
        """Rows of one prompt's group in TransferQueue: n_samples_per_prompt x chains_per_episode."""
        return self.n_samples_per_prompt * self.chains_per_episode

    @property
    def iters_per_step(self) -> int:
        """num_iters_per_train_update, which validation sets when the run leaves it None."""
        if self.num_iters_per_train_update is None:
            raise ValueError("num_iters_per_train_update is unset: the run config was not validated")
        return self.num_iters_per_train_update

    @property
    def rows_per_step(self) -> int:
        return self.rollout_batch_size * self.group_rows

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
