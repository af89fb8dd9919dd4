"""Trainer ranks start the way torch users start them: under torchrun, from its environment variables."""

import os
import subprocess
import sys

from services.runtime.processes import free_port
from services.trainer.config import TrainerConfig


def test_torchrun_environment_gives_the_ranks_and_flags_win(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29500")
    c = TrainerConfig()
    assert (c.dp_rank, c.dp_size, c.dp_master) == (1, 2, "10.0.0.5:29500")
    c = TrainerConfig(dp_rank=0, dp_master="127.0.0.1:1234")
    assert (c.dp_rank, c.dp_size, c.dp_master) == (0, 2, "127.0.0.1:1234")


def test_two_ranks_under_torchrun_form_their_group(tmp_path):
    out = tmp_path / "sum.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "tests.trainer.torchrun_worker",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_text() == "2 3.0"  # ranks 0 and 1 contributed 1 and 2
