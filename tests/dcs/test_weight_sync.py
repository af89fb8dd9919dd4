"""Weight sync end to end: DCS, a trainer and receivers, each its own process, over real gloo groups."""

from __future__ import annotations

import json
import sys

import pytest

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.runtime.processes import ChildProcess
from tests.worker_fork_server import worker_fork_server


pytestmark = pytest.mark.slow  # several processes end to end; ./dev test runs it


def _events(path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _worker(tmp_path, name, *args) -> ChildProcess:
    return ChildProcess(
        name,
        [sys.executable, "-m", "tests.dcs.sync_worker", *args],
        str(tmp_path / f"{name}.log"),
        forker=worker_fork_server(),
    )


def start_three(
    tmp_path,
    dcs_url: str,
    run_id: str,
    versions: int,
    faulty: str,
    fault: list[str],
    trainer_args: tuple[str, ...] = (),
) -> tuple[ChildProcess, ChildProcess, ChildProcess]:
    """A trainer publishing `versions` versions to two receivers, "survivor" and `faulty` (which takes the
    `fault` flags); each writes its events to <name>.jsonl. Callers give the coordinator a 3 s node lease: the
    trainer retries a failed sync after 4 s, once the dead member has been dropped."""
    common = ["--dcs", dcs_url, "--run-id", run_id, "--timeout-s", "3"]
    survivor = _worker(
        tmp_path, "survivor", "receiver", *common, "--until", str(versions), "--out", str(tmp_path / "survivor.jsonl")
    )
    other = _worker(
        tmp_path,
        faulty,
        "receiver",
        *common,
        "--until",
        str(versions),
        *fault,
        "--out",
        str(tmp_path / f"{faulty}.jsonl"),
    )
    trainer = _worker(
        tmp_path,
        "trainer",
        "trainer",
        *common,
        "--versions",
        str(versions),
        "--retry-after-s",
        "4",
        *trainer_args,
        "--out",
        str(tmp_path / "trainer.jsonl"),
    )
    return survivor, other, trainer


@pytest.mark.parametrize(
    "dtype,streamed",
    [("float32", False), ("bfloat16", False), ("float32", True)],
    ids=["float32", "bfloat16", "streamed"],
)
def test_trainer_and_two_receivers_get_bit_identical_tensors(tmp_path, dtype, streamed):
    with LocalDCS(log_dir=str(tmp_path)) as dcs:
        common = ["--dcs", dcs.url, "--run-id", "r", "--dtype", dtype]
        receivers = [
            _worker(
                tmp_path, f"recv{i}", "receiver", *common, "--until", "2", "--out", str(tmp_path / f"recv{i}.jsonl")
            )
            for i in range(2)
        ]
        trainer = _worker(
            tmp_path,
            "trainer",
            "trainer",
            *common,
            "--versions",
            "2",
            "--out",
            str(tmp_path / "trainer.jsonl"),
            *(["--streamed"] if streamed else []),
        )
        assert trainer.proc.wait(120) == 0, trainer.log_tail()
        for r in receivers:
            assert r.proc.wait(60) == 0, r.log_tail()
        published = {e["version"]: e for e in _events(tmp_path / "trainer.jsonl") if e["event"] == "published"}
        assert sorted(published) == [1, 2] and published[1]["world_size"] == 3
        assert set(published[1]["seconds"]) >= {"metadata", "pack", "broadcast", "total"}
        if streamed:  # taken a bucket at a time (40 kB buckets: 64 kB, 16, 32+1 kB, 64 kB tensors), then closed
            assert published[1]["takes"] == [1, 1, 2, 1] and published[1]["closed"]
        for i in range(2):
            got = {e["version"]: e["digest"] for e in _events(tmp_path / f"recv{i}.jsonl") if e["event"] == "received"}
            assert got == {v: published[v]["digest"] for v in (1, 2)}
        with DCSClient(dcs.url) as c:
            assert c.latest_weights("r").version == 2
            receivers_seen = c.topology().roles["actor_fwd"]
            assert all(n.weight_version == 2 for n in receivers_seen)  # versions visible in status
            reports = c.sync_reports("r", 20)
            assert any(r.ok and r.bytes > 0 and "broadcast" in r.seconds for r in reports)
            assert any("load" in r.seconds for r in reports)  # receivers report the load phase too


@pytest.mark.parametrize("streamed", [False, True], ids=["list", "streamed"])
def test_receiver_killed_mid_sync_fails_it_on_time_and_the_next_sync_succeeds(tmp_path, streamed):
    with LocalDCS(log_dir=str(tmp_path), args=("--node-lease-s", "3.0")) as dcs:
        survivor, doomed, trainer = start_three(
            tmp_path, dcs.url, "k", 3, "doomed", ["--die-at", "2:1"], trainer_args=("--streamed",) if streamed else ()
        )
        assert trainer.proc.wait(120) == 0, trainer.log_tail()
        assert survivor.proc.wait(60) == 0, survivor.log_tail()
        assert doomed.proc.wait(10) == -9  # it really died mid-sync
        events = {e["version"]: e for e in _events(tmp_path / "trainer.jsonl")}
        assert events[1]["event"] == "published" and events[1]["world_size"] == 3
        assert events[2]["event"] == "failed"
        if streamed:  # closed although the broadcast failed part-way (a sharded trainer's peers wait for it)
            assert events[2]["closed"]
        assert events[2]["seconds"]["total"] < 2 * 3 + 5  # within the deadline, not gloo's 30 s
        assert events[3]["event"] == "published" and events[3]["world_size"] == 2  # the dead member dropped
        seen = _events(tmp_path / "survivor.jsonl")
        received = {e["version"]: e["digest"] for e in seen if e["event"] == "received"}
        assert received == {1: events[1]["digest"], 3: events[3]["digest"]}
        failed = [e for e in seen if e["event"] == "failed"]
        assert [e["version"] for e in failed] == [2]
        assert failed[0]["serving"] == events[1]["digest"]  # the old weights kept serving
