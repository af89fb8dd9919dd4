from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.role.role_service import RoleSettings


class AdvantageConfig(RoleSettings):
    """`sluice advantage`: waits for whole prompt groups of train_<step> with the fields its estimator
    needs (rewards; log_probs and ref_log_probs for a KL reward penalty; values for PPO) and writes
    `advantages` and `returns`. The estimator and its parameters are the run's config."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_ADVANTAGE_")

    port: int = Field(7520, ge=0, le=65535, description="port of /healthz /readyz /status /metrics")
    max_groups_per_batch: int = Field(0, ge=0, description="groups computed together; 0 = a whole step's worth")
    lease_s: float = Field(60.0, gt=0, description="claim lease: rows return to the queue if this node dies")
