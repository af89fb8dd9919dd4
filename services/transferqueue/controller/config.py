from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.runtime.auth_token import AuthTokenSettings
from services.runtime.tls import TLSSettings


class ControllerConfig(AuthTokenSettings, TLSSettings):
    """`sluice tq-controller`: TransferQueue metadata service (gRPC; all state in Redis)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_TQ_")

    host: str = Field("0.0.0.0", description="address to bind the gRPC server to")
    port: int = Field(7400, description="gRPC port (0 = pick a free one and log it)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding all metadata")
    key_prefix: str = Field("tq", description="prefix of every Redis key (several queues can share a Redis)")
    metrics_port: int = Field(0, description="Prometheus /metrics port; 0 = disabled")
    default_lease_ms: int = Field(60_000, ge=1, description="lease of a claim that does not name one")
    max_wait_ms: int = Field(300_000, ge=0, description="upper bound on a claim's long-poll wait")
    shard_call_timeout_s: float = Field(5.0, gt=0, description="deadline of controller->shard drop calls")
    grace_s: float = Field(5.0, ge=0, description="on SIGTERM, time in-flight calls get to finish")
    log_level: str = Field("info", description="debug|info|warning|error")
    # input bounds (docs/transferqueue.md#limits): checked before any Redis function runs
    max_rows_per_call: int = Field(
        262_144, ge=1, le=1 << 22, description="most rows one put, commit, claim, ack or row check may name"
    )
    max_partition_rows: int = Field(
        1 << 24, ge=1, le=1 << 40, description="row indices of a partition are below this (its allocation cap)"
    )
    max_partitions: int = Field(100_000, ge=1, description="partitions that may exist at once")
    max_tasks: int = Field(10_000, ge=1, description="tasks that may be registered")
    max_readiness_rows: int = Field(
        1 << 20,
        ge=1,
        le=1 << 40,
        description="most rows a task registered late, "
        "or a task reset, may recompute its readiness over in one call (the work one "
        "Redis call may do); more is refused with FAILED_PRECONDITION",
    )
    max_fields_per_call: int = Field(256, ge=1, description="most fields one put, task or read may name")
    max_row_elements: int = Field(1 << 24, ge=1, description="most elements per row of a TENSOR field")
    max_lease_ms: int = Field(3_600_000, ge=1, description="longest lease a claim or extension may ask for")
    max_shard_ttl_ms: int = Field(600_000, ge=1, description="longest registration TTL a shard may ask for")
    max_message_bytes: int = Field(
        16 << 20, ge=1 << 16, description="largest gRPC message it receives or sends (RESOURCE_EXHAUSTED)"
    )
    reservation_ttl_s: float = Field(
        900.0, gt=0, le=86_400, description="how long a put reservation lets shards accept its rows"
    )

    @model_validator(mode="after")
    def _default_lease_within_cap(self) -> "ControllerConfig":
        if self.default_lease_ms > self.max_lease_ms:
            raise ValueError(f"default_lease_ms {self.default_lease_ms} exceeds max_lease_ms {self.max_lease_ms}")
        return self
