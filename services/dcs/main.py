"""Entry point of `sluice dcs`."""

from __future__ import annotations

import sys

from services.dcs.config import DCSConfig
from services.dcs.server import serve
from services.runtime.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(DCSConfig, "dcs", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
