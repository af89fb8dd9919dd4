"""Entry point of `sluice trainer`."""

from __future__ import annotations

import sys

from services.runtime.service_main import run_service
from services.trainer.config import TrainerConfig
from services.trainer.service import serve


def main(argv: list[str] | None = None) -> int:
    return run_service(TrainerConfig, "trainer", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
