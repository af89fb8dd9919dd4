"""Entry point of `sluice advantage`."""

from __future__ import annotations

import sys

from services.advantage.config import AdvantageConfig
from services.advantage.service import serve
from services.runtime.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(AdvantageConfig, "advantage", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
