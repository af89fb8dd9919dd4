"""Entry point of `sluice tq-controller`."""

from __future__ import annotations

import sys

from services.runtime.service_main import run_service
from services.transferqueue.controller.config import ControllerConfig
from services.transferqueue.controller.server import serve


def main(argv: list[str] | None = None) -> int:
    return run_service(ControllerConfig, "tq-controller", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
