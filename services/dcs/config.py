from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DCSConfig(BaseSettings):
    """`sluice dcs`: the control plane (HTTP/FastAPI; all state in Redis): node registration and
    heartbeats, topology, versioned weight metadata, broadcast groups, run control."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_DCS_")

    host: str = Field("0.0.0.0", description="address to bind the HTTP server to")
    port: int = Field(7300, description="HTTP port")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding all coordinator state")
    key_prefix: str = Field("dcs", description="prefix of every Redis key")
    auth_token: str = Field("", description="bearer token every endpoint but health requires; empty = no auth")
    node_lease_s: float = Field(10.0, gt=0, description="a node whose heartbeats stop for this long is dead")
    max_wait_s: float = Field(300.0, ge=0, description="upper bound on long-poll waits")
    log_level: str = Field("info", description="debug|info|warning|error")
