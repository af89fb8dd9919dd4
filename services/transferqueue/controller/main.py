"""Entry point of `sluice tq-controller`."""

from __future__ import annotations

import asyncio
import sys

from services.runtime.logs import configure_logging
from services.runtime.metrics import serve_metrics
from services.runtime.settings_cli import parse_settings
from services.runtime.shutdown import shutdown_event
from services.transferqueue.controller.config import ControllerConfig
from services.transferqueue.controller.server import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_settings(ControllerConfig, argv, "sluice tq-controller", ControllerConfig.__doc__)
    configure_logging("tq-controller", config.log_level)
    serve_metrics(config.host, config.metrics_port)

    async def run() -> None:
        await serve(config, shutdown_event())

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
