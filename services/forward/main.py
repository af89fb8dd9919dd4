"""Entry point of `sluice forward`."""

from __future__ import annotations

import sys

from services.forward.config import ForwardConfig
from services.forward.service import serve
from services.runtime.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(ForwardConfig, "forward", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
