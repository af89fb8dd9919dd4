"""benchmarks/tq_load.py in CI, in its smoke setting: 8, 32 and 128 concurrent clients (each its own
AsyncTransferQueue, over two client processes) against a fresh real stack per level for 5 s each, putting,
claiming, reading and acking as fast as they can. No call may fail, and every row put must be acked exactly
once, intact. Latencies and rows/s are printed by the benchmark, not asserted (no timing thresholds in tests);
the full 60 s levels are in docs/performance.md."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BENCHMARK = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "tq_load.py"


def test_eight_thirty_two_and_a_hundred_twenty_eight_clients_with_no_error_and_no_row_lost():
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--clients", "8,32,128"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert [level["clients"] for level in result["levels"]] == [8, 32, 128]
    for level in result["levels"]:
        assert level["errors"]["count"] == 0, (level["clients"], level["error_samples"])
        assert level["rows_put"] > 0 and level["rows_moved"] == level["rows_put"], level
        assert level["claims"] > 0 and level["puts"] > 0
        assert set(level["peak_rss_mib"]) == {"controller", "shard", "redis"}
    assert result["errors_total"] == 0 and result["ok"] is True
