"""Entry point of `sluice engine`."""

from __future__ import annotations

import sys

from services.engine.config import EngineConfig
from services.engine.server import serve
from services.runtime.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(EngineConfig, "engine", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
