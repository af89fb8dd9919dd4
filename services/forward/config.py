from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.role.role_service import RoleSettings


class ForwardConfig(RoleSettings):
    """`sluice forward --role actor_fwd|reference`: claims rows of train_<step>, computes per-token
    log-probs of each response under its weights (batched, padding-aware), writes `log_probs`
    (actor_fwd) or `ref_log_probs` (reference) and acks. actor_fwd receives every new weight version;
    reference one every ref_update_interval versions (never by default)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_FORWARD_")

    role: str = Field("actor_fwd", pattern="^(actor_fwd|reference)$", description="actor_fwd or reference")
    port: int = Field(7510, ge=0, le=65535, description="port of /healthz /readyz /status /metrics")
    micro_batch_size: int = Field(0, ge=0, description="samples per forward pass; 0 = the run's micro_batch_size")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    dtype: str = Field("float32", pattern="^(float32|bfloat16)$", description="weights dtype (log-probs are float32)")
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="deadline of each weight broadcast")
    checkpoint_dir: str = Field(
        "",
        description=(
            "the trainer's checkpoint directory, if shared: a restarted actor_fwd loads the checkpoint of the "
            "latest published version from it instead of waiting for the next version"
        ),
    )
    lease_s: float = Field(120.0, gt=0, description="claim lease: rows return to the queue if this node dies")
