"""Entry point of `sluice rollout`."""

from __future__ import annotations

import sys

from services.rollout.config import RolloutConfig
from services.rollout.service import serve
from services.runtime.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(RolloutConfig, "rollout", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
