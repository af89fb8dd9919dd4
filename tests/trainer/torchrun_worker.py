"""A trainer rank as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment, no rank
flags): its TrainerConfig takes the ranks from there and its data-parallel group forms; rank 0 writes what the
group summed."""

import sys

from services.trainer.config import TrainerConfig
from services.trainer.data_parallel import DataParallel


def main() -> None:
    c = TrainerConfig()
    dp = DataParallel(c.dp_rank, c.dp_size, c.dp_master, timeout_s=60)
    total = dp.total(float(c.dp_rank + 1))
    if dp.is_leader:
        with open(sys.argv[1], "w") as f:
            f.write(f"{c.dp_size} {total}")
    dp.close()


if __name__ == "__main__":
    main()
