"""Entry point of `sluice tq-shard`."""

from __future__ import annotations

import sys

from services.runtime.service_main import run_service
from services.transferqueue.shard.config import ShardConfig
from services.transferqueue.shard.server import serve


def main(argv: list[str] | None = None) -> int:
    return run_service(ShardConfig, "tq-shard", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
