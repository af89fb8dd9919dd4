"""A receiver frozen with SIGSTOP in the middle of a weight sync (real coordinator, real gloo groups
between processes): the sync fails within its deadline, the next version reaches the other receiver
without it, and after SIGCONT the frozen receiver rejoins and gets a whole later version, bit-identical."""

from __future__ import annotations

import signal
import time

import pytest

from services.dcs.local import LocalDCS
from tests.dcs.test_weight_sync import _events, start_three

pytestmark = pytest.mark.slow


def _wait_for(path, predicate, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = _events(path) if path.exists() else []
        if predicate(events):
            return events
        time.sleep(0.1)
    raise AssertionError(f"{path.name}: not seen in {timeout_s} s; events: {events}")


def test_a_receiver_stopped_mid_sync_is_left_out_then_rejoins_after_sigcont(tmp_path):
    with LocalDCS(log_dir=str(tmp_path), args=("--node-lease-s", "3.0")) as dcs:
        survivor, frozen, trainer = start_three(
            tmp_path, dcs.url, "s", 4, "frozen", ["--stop-at", "2:1"], ("--rejoin-version", "4")
        )
        try:
            published = _wait_for(tmp_path / "trainer.jsonl", lambda es: any(e["version"] == 3 for e in es))
            assert frozen.alive()  # stopped, not dead
            frozen.proc.send_signal(signal.SIGCONT)
            assert trainer.proc.wait(120) == 0, trainer.log_tail()
            assert survivor.proc.wait(60) == 0, survivor.log_tail()
            assert frozen.proc.wait(60) == 0, frozen.log_tail()
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
        events = {e["version"]: e for e in _events(tmp_path / "trainer.jsonl")}
        assert events[1]["event"] == "published" and events[1]["world_size"] == 3
        assert events[2]["event"] == "failed"
        assert events[2]["seconds"]["total"] < 2 * 3 + 5  # within the deadline, not gloo's 30 s
        assert events[3]["event"] == "published" and events[3]["world_size"] == 2  # without the frozen one
        assert events[4]["event"] == "published" and events[4]["world_size"] == 3  # it is back
        assert published  # the SIGCONT came after version 3 was out
        survivor_got = {
            e["version"]: e["digest"] for e in _events(tmp_path / "survivor.jsonl") if e["event"] == "received"
        }
        assert survivor_got == {1: events[1]["digest"], 3: events[3]["digest"], 4: events[4]["digest"]}
        frozen_events = _events(tmp_path / "frozen.jsonl")
        frozen_got = {e["version"]: e["digest"] for e in frozen_events if e["event"] == "received"}
        assert frozen_got == {1: events[1]["digest"], 4: events[4]["digest"]}  # a whole version 4
        assert [e["version"] for e in frozen_events if e["event"] == "failed"] == [2]
