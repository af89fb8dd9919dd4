"""Entry point of `sluice tq-shard`."""

from __future__ import annotations

import asyncio
import sys

from services.runtime.logs import configure_logging
from services.runtime.metrics import serve_metrics
from services.runtime.settings_cli import parse_settings
from services.runtime.shutdown import shutdown_event
from services.transferqueue.shard.config import ShardConfig
from services.transferqueue.shard.server import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_settings(ShardConfig, argv, "sluice tq-shard", ShardConfig.__doc__)
    configure_logging("tq-shard", config.log_level)
    serve_metrics(config.host, config.metrics_port)

    async def run() -> None:
        await serve(config, shutdown_event())

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
