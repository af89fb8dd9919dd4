from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControllerConfig(BaseSettings):
    """`sluice tq-controller`: TransferQueue metadata service (gRPC; all state in Redis)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_TQ_")

    host: str = Field("0.0.0.0", description="address to bind the gRPC server to")
    port: int = Field(7400, description="gRPC port (0 = pick a free one and log it)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding all metadata")
    key_prefix: str = Field("tq", description="prefix of every Redis key (several queues can share a Redis)")
    auth_token: str = Field("", description="bearer token every call must carry; empty = no auth")
    metrics_port: int = Field(0, description="Prometheus /metrics port; 0 = disabled")
    default_lease_ms: int = Field(60_000, ge=1, description="lease of a claim that does not name one")
    max_wait_ms: int = Field(300_000, ge=0, description="upper bound on a claim's long-poll wait")
    shard_call_timeout_s: float = Field(5.0, gt=0, description="deadline of controller->shard drop calls")
    grace_s: float = Field(5.0, ge=0, description="on SIGTERM, time in-flight calls get to finish")
    log_level: str = Field("info", description="debug|info|warning|error")
