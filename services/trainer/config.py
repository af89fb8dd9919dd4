import os

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.role.role_service import RoleSettings
from services.trainer.precision import PRECISION_PATTERN, check_precision


class TrainerConfig(RoleSettings):
    """`sluice trainer` (torch backend): streams actor_train batches of train_<step> from TransferQueue
    while the partition fills, takes num_iters_per_train_update optimizer steps per step (PPO-style
    clipped loss, KL, entropy, decoupled PPO / truncated IS), publishes the new weights through the
    coordinator, clears the partition and checkpoints on the run's interval; resumes from the latest
    checkpoint on start. `--role critic` trains the PPO value model and writes `values` instead."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_TRAINER_")

    role: str = Field("actor", pattern="^(actor|critic)$", description="actor or critic")
    port: int = Field(7530, ge=0, le=65535, description="port of /healthz /readyz /status /metrics")
    checkpoint_dir: str = Field("", description="where checkpoints go and are resumed from; empty = none")
    output_dir: str = Field(
        "runs",
        description=(
            "the run's files go to <output_dir>/<run_id>: steps.jsonl, completions.jsonl and the tracking backends' "
            "files (tensorboard/, wandb/, mlflow/; the run's tracking.report_to), the input of `sluice report`; "
            "empty = none (actor rank 0 only)"
        ),
    )
    adapter_dir: str = Field(
        "",
        description=(
            "trainer.lora with SGLang engines: where each published adapter is written in peft's files "
            "(<run_id>-v<version>/) for the engines to load by path (/load_lora_adapter); they read it at the same path, "
            "so with engines on other hosts it must be on a shared filesystem; empty = <output_dir>/<run_id>/adapters"
        ),
    )
    device: str = Field("cpu", description="cpu or cuda[:N]")
    master_address: str = Field("127.0.0.1", description="address receivers reach this trainer's broadcast group at")
    bucket_mb: int = Field(64, ge=1, description="weight-sync bucket size (MiB)")
    sync_backend: str = Field(
        "auto",
        pattern="^(auto|gloo|nccl|ipc)$",
        description=(
            "how published weights travel: gloo (through host memory: any device), nccl (GPU to GPU: every receiver "
            "on another GPU), ipc (CUDA IPC handles: built-in engines on the trainer's own GPU), auto (gloo from a "
            "CPU; from a GPU nccl, or ipc when every receiver is an engine on the trainer's GPU, else gloo)"
        ),
    )
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="deadline of each weight broadcast")
    pause_mode: str = Field(
        "auto",
        pattern="^(auto|abort|in_place|retract|none)$",
        description=(
            "how engines pause for a weight update: abort (requests resume as partial rollouts), in_place "
            "(frozen with their KV cache), retract (requeued, KV recomputed), none (no pause: the built-in "
            "engine keeps generating while it receives and loads the version between two steps), auto (none for "
            "the built-in engine, abort for SGLang servers)"
        ),
    )
    backend: str = Field(
        "torch",
        pattern="^(torch|fsdp|megatron)$",
        description=(
            "actor training backend: torch (every rank holds the whole model), fsdp (FSDP2: parameters, gradients "
            "and optimizer state sharded over the --dp-size ranks) or megatron (megatron-core: tensor and pipeline "
            "parallel, --tp-size x --pp-size ranks per model replica); the critic trains with torch"
        ),
    )
    tp_size: int = Field(1, ge=1, le=64, description="megatron: tensor-parallel size")
    pp_size: int = Field(1, ge=1, le=64, description="megatron: pipeline-parallel size")
    sequence_parallel: bool = Field(
        False,
        description="megatron: split norm and residual activations along the "
        "sequence over the tensor-parallel ranks (with tp_size > 1)",
    )
    fsdp_param_dtype: str = Field(
        "",
        pattern="^(|bfloat16|float16)$",
        description=("fsdp: compute in this dtype (gradients reduced in float32); empty = the model's float32"),
    )
    precision: str = Field(
        "fp32",
        pattern=PRECISION_PATTERN,
        description=(
            "fp32 (float32 weights, AdamW state and compute), bf16-mixed (float32 master weights and AdamW state, "
            "forward and backward under bfloat16 autocast; with fsdp: FSDP2's bfloat16 mixed precision) or bf16 "
            "(the weights, gradients and AdamW state themselves in bfloat16: the memory-saving choice); log-probs and "
            "the loss are float32 in every case; megatron: fp32 only"
        ),
    )
    auto_micro_batch: bool = Field(
        False,
        description=(
            "on a GPU, size each step's micro-batches from the memory the device has left (each step measures what a "
            "token costs; an engine on the same GPU keeps its share); off, or on a CPU: the run's micro_batch_size; "
            "torch backend only (fsdp and megatron ranks must run the same number of micro-batches)"
        ),
    )
    tf32: bool = Field(
        True,
        description="on a CUDA device, float32 matmuls and convolutions in TF32 "
        "(--no-tf32: full float32); no effect on CPU",
    )
    fsdp_cpu_offload: bool = Field(
        False, description="fsdp: keep sharded parameters and optimizer state in CPU memory (for a CUDA device)"
    )
    dp_size: int = Field(
        1, ge=1, description=("actor ranks (one process each); with megatron, TP x PP x data-parallel replicas")
    )
    dp_rank: int = Field(
        0, ge=0, description="this process's data-parallel rank; rank 0 leads (claims, publishes, checkpoints)"
    )
    dp_master: str = Field("", description="host:port of rank 0's rendezvous for the data-parallel group")
    # 1 s: an engine that joined the run's set after a publish (its rollout started later than the trainer) holds
    # back the samples the trainer waits for until this check sends it the weights; the check is one coordinator
    # read, made only while waiting
    republish_check_s: float = Field(
        1.0,
        gt=0,
        description=(
            "while waiting for data, how often to check for engines serving older weights than the published "
            "version (restarted, joined after a publish, or missed one) and publish again"
        ),
    )
    final_sync_wait_s: float = Field(
        60.0,
        ge=0,
        description=(
            "after the last step: how long to wait for engines of the run that are down (restarting) or serve older "
            "weights, sending them the last weights, before the run is recorded as finished"
        ),
    )
    snapshot_publish_mb: int = Field(
        2048,
        ge=0,
        le=1 << 30,
        description=(
            "publish (and checkpoint) from a copy, so the next step trains while the weights are sent and written, "
            "when it is at most this many MiB (the weights; for a checkpoint with the optimizer's two moments: 3x); "
            "larger models use the live weights and the next optimizer step waits; 0 = never copy"
        ),
    )
    lease_s: float = Field(300.0, gt=0, description="claim lease: rows return to the queue if this node dies")
    clear_wait_s: float = Field(600.0, gt=0, description="how long to wait for every task to consume a step")

    @property
    def adapter_files_dir(self) -> str | None:
        """--adapter-dir, absolute (an engine reads the path as it is given); None with it and --output-dir empty."""
        directory = self.adapter_dir or (
            os.path.join(self.output_dir, self.run_id, "adapters") if self.output_dir else ""
        )
        return os.path.abspath(directory) if directory else None

    @model_validator(mode="after")
    def _micro_batches_fit_backend(self):
        if self.auto_micro_batch and self.role == "actor" and self.backend != "torch":
            raise ValueError(
                f"--auto-micro-batch needs --backend torch: {self.backend}'s ranks each run every "
                "micro-batch's collectives, so they must split alike; set the run's micro_batch_size"
            )
        return self

    @model_validator(mode="after")
    def _precision_fits_backend(self):
        check_precision(self.backend if self.role == "actor" else "torch", self.precision, self.fsdp_param_dtype)
        return self

    @model_validator(mode="before")
    @classmethod
    def _ranks_from_torchrun(cls, data):
        """Ranks as torchrun (and torch.distributed's env:// rendezvous) set them: RANK, WORLD_SIZE,
        MASTER_ADDR and MASTER_PORT give --dp-rank, --dp-size and --dp-master when those are not set."""
        if not isinstance(data, dict) or "WORLD_SIZE" not in os.environ:
            return data
        env = os.environ
        defaults = {"dp_size": env.get("WORLD_SIZE"), "dp_rank": env.get("RANK")}
        if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            defaults["dp_master"] = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        return {**{k: v for k, v in defaults.items() if v is not None}, **data}
