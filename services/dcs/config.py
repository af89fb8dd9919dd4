from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.runtime.auth_token import AuthTokenSettings
from services.runtime.tls import TLSSettings


class DCSConfig(AuthTokenSettings, TLSSettings):
    """`sluice dcs`: the control plane (HTTP/FastAPI; all state in Redis): node registration and
    heartbeats, topology, versioned weight metadata, broadcast groups, run control."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_DCS_")

    host: str = Field("0.0.0.0", description="address to bind the HTTP server to")
    port: int = Field(7300, description="HTTP port")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="a second port serving only /metrics, without the "
        "token (for Prometheus scrapes inside the cluster); 0 = off",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding all coordinator state")
    key_prefix: str = Field("dcs", description="prefix of every Redis key")
    node_lease_s: float = Field(10.0, gt=0, description="a node whose heartbeats stop for this long is dead")
    dead_node_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=1e7,
        description="a dead node's record is dropped once its "
        "last heartbeat is this old (a restarted role registers anew)",
    )
    max_wait_s: float = Field(300.0, ge=0, description="upper bound on long-poll waits")
    log_level: str = Field("info", description="debug|info|warning|error")
