import socket

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.runtime.auth_token import AuthTokenSettings
from services.runtime.tls import TLSSettings


class ShardConfig(AuthTokenSettings, TLSSettings):
    """`sluice tq-shard`: TransferQueue storage shard (gRPC; field data as Arrow in memory, journaled to
    --data-dir when set)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_TQ_SHARD_")

    host: str = Field("0.0.0.0", description="address to bind the gRPC server to")
    port: int = Field(7410, description="gRPC port (0 = pick a free one)")
    shard_id: str = Field("", description="stable id of this shard; default <hostname>-<port>")
    advertise_host: str = Field("", description="host clients dial (with the bound port); default the hostname")
    controller: str = Field("127.0.0.1:7400", description="controller host:port to register with")
    max_rows: int = Field(1_000_000, gt=0, description="row budget; puts beyond it get RESOURCE_EXHAUSTED")
    max_bytes: int = Field(8 << 30, gt=0, description="byte budget; puts beyond it get RESOURCE_EXHAUSTED")
    chunk_bytes: int = Field(4 << 20, gt=0, le=32 << 20, description="size of the data chunks it streams")
    register_interval_s: float = Field(3.0, gt=0, description="how often it renews its registration")
    orphan_grace_s: float = Field(
        30.0, ge=0, description="partitions unknown to the controller for this long are dropped"
    )
    data_dir: str = Field(
        "",
        description="directory of the write-ahead journal; a restarted shard replays it and "
        "holds every row it acknowledged. Empty: memory only (rows die with the "
        "process)",
    )
    journal_fsync: bool = Field(
        False,
        description="fsync each journal write before acknowledging it (survives "
        "the machine failing, not only the process)",
    )
    journal_compact_bytes: int = Field(
        256 << 20, ge=1 << 20, description="rewrite the journal once it is over this and twice what is held"
    )
    metrics_port: int = Field(0, description="Prometheus /metrics port; 0 = disabled")
    grace_s: float = Field(5.0, ge=0, description="on SIGTERM, time in-flight calls get to finish")
    log_level: str = Field("info", description="debug|info|warning|error")
    # input bounds (docs/transferqueue.md#limits): checked before anything is parsed or stored
    max_rows_per_call: int = Field(262_144, ge=1, le=1 << 22, description="most rows one put, get or delete may name")
    max_partition_rows: int = Field(1 << 24, ge=1, le=1 << 40, description="row indices must be below this")
    max_fields_per_call: int = Field(256, ge=1, description="most fields one put, get or delete may name")
    max_row_elements: int = Field(1 << 24, ge=1, description="most elements per row of a TENSOR column")
    max_put_bytes: int = Field(1 << 30, ge=1, description="largest Arrow stream one put may send (RESOURCE_EXHAUSTED)")
    max_response_bytes: int = Field(
        1 << 30, ge=1, description="largest Arrow stream one get may return (RESOURCE_EXHAUSTED)"
    )
    max_message_bytes: int = Field(
        64 << 20, ge=1 << 16, description="largest gRPC message it receives or sends (RESOURCE_EXHAUSTED)"
    )

    def resolved_id(self, port: int) -> str:
        return self.shard_id or f"{socket.gethostname()}-{port}"

    def resolved_address(self, port: int) -> str:
        return f"{self.advertise_host or socket.gethostname()}:{port}"
