"""Which engines a publisher leaves out of its syncs (services/dcs/sync/unresponsive.py), with fake engine
clients: after a failed sync the ones that do not answer /health; they rejoin once a background probe, made at
a later sync, has seen them answer; a sync never waits for a probe."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from services.dcs.sync.unresponsive import UnresponsiveEngines


class FakeEngine:
    def __init__(self, url: str, answers: bool = True, hang: threading.Event | None = None):
        self.base_url, self.answers, self.hang, self.closed = url, answers, hang, False

    def health(self) -> bool:
        if self.hang is not None:
            self.hang.wait(10)
        return self.answers

    def close(self) -> None:
        self.closed = True


def test_an_engine_that_does_not_answer_is_left_out_until_it_does():
    answers = [False, True]  # what b's successive probes hear
    released = threading.Event()
    made: list[FakeEngine] = []

    def client_for(url: str) -> FakeEngine:
        made.append(FakeEngine(url, answers.pop(0), None if made else released))  # the first probe hangs
        return made[-1]

    with ThreadPoolExecutor(4) as pool:
        engines = UnresponsiveEngines(pool, client_for)
        engines.readmit()  # nothing left out: nothing asked
        assert made == [] and engines.excluded() == []
        engines.after_failure({"a": FakeEngine("http://a"), "b": FakeEngine("http://b", answers=False)})
        assert engines.excluded() == ["b"]
        began = time.monotonic()
        engines.readmit()  # the probe hangs: the sync goes on without waiting, still without b
        assert time.monotonic() - began < 5 and engines.excluded() == ["b"]  # the probe hangs until released
        released.set()  # the first probe answers "no"; the next sync starts another, which answers "yes"
        _until(lambda: engines._probes["b"].done())  # (the client closes a moment before the answer is kept)
        engines.readmit()
        assert made[0].closed and engines.excluded() == ["b"]
        _until(lambda: len(made) == 2 and engines._probes["b"].done())
        engines.readmit()
        assert made[1].closed
        assert engines.excluded() == []


def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)
