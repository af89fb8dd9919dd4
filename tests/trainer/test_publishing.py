"""A step's publish runs beside the next step: a snapshot publish sends the weights as they were when the step
ended, even while the optimizer moves them; a live publish holds the optimizer (settle_live) until it is sent."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from services.dcs.sync.unresponsive import UnresponsiveEngines
from services.run_contract.run_config import RunConfig
from services.trainer import publishing
from services.trainer.publishing import WeightVersions
from tests.fakes.weights import FakeWeightPublisher, InMemoryCoordinator


class GatedPublisher(FakeWeightPublisher):
    """Publishes only once `gate` is set, so the test can move the weights while a publish is in flight."""

    def __init__(self, coordinator: InMemoryCoordinator):
        super().__init__(coordinator)
        self.gate, self.started = threading.Event(), threading.Event()

    def publish(self, named, version: int, announce: bool = True):
        self.started.set()
        assert self.gate.wait(10)
        return super().publish(named, version, announce)


def _versions(model) -> tuple[WeightVersions, GatedPublisher, InMemoryCoordinator]:
    coordinator = InMemoryCoordinator()
    sender = GatedPublisher(coordinator)
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    return WeightVersions(sender, model, run, coordinator, "r", republish_check_s=60.0), sender, coordinator


def test_a_snapshot_publish_sends_the_weights_of_its_step_while_the_optimizer_moves_them():
    model = torch.nn.Linear(3, 2)
    weights, sender, coordinator = _versions(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = []
    weights.publish_later(0, 1, done.append, snapshot=True)
    assert sender.started.wait(10)
    weights.settle_live()  # returns at once: the publish reads its own copy
    assert weights.in_flight_version == 1 and not done
    with torch.no_grad():  # the next step's optimizer moves the weights meanwhile
        for p in model.parameters():
            p.add_(1.0)
    sender.gate.set()
    weights.settle()
    assert done == [1] and weights.in_flight_version is None
    published = coordinator.published[0]
    assert published.version == 1
    for name, tensor in trained.items():
        assert torch.equal(published.tensors[name], tensor)  # the step's weights, not the moved ones


def test_a_live_publish_holds_the_optimizer_until_it_is_sent():
    model = torch.nn.Linear(3, 2)
    weights, sender, coordinator = _versions(model)
    weights.publish_later(0, 1, lambda v: None, snapshot=False)
    assert sender.started.wait(10)
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: (weights.settle_live(), settled.set()))
    waiter.start()
    assert not settled.wait(0.2)  # the optimizer may not move the weights yet
    sender.gate.set()
    assert settled.wait(10)
    waiter.join()
    assert [p.version for p in coordinator.published] == [1]


def test_weights_larger_than_the_snapshot_limit_are_published_live():
    model = torch.nn.Linear(3, 2)  # 8 parameters, 32 bytes
    coordinator = InMemoryCoordinator()
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    assert WeightVersions(
        FakeWeightPublisher(coordinator), model, run, coordinator, "r", 60.0, snapshot_max_bytes=32
    ).snapshot_fits
    assert not WeightVersions(
        FakeWeightPublisher(coordinator), model, run, coordinator, "r", 60.0, snapshot_max_bytes=31
    ).snapshot_fits


class EngineTopology(InMemoryCoordinator):
    """A coordinator whose engine set is scripted: `scripted` (alive, recorded weight_version) per node, changed by
    the test, each added to the run (kept by its rollout) unless named in `registered_themselves`; an engine in
    `loads` takes each publish it is alive for, and the record says so as the publish returns (its sync report)."""

    def __init__(self, engines: dict[str, tuple[bool, int | None]]):
        super().__init__()
        self.scripted = engines
        self.loads: set[str] = set()
        self.registered_themselves: set[str] = set()

    def engines(self, run_id: str) -> SimpleNamespace:  # GET /v1/runs/{run_id}/engines
        assert run_id == "r"
        return SimpleNamespace(
            engines=[
                SimpleNamespace(
                    node_id=k, alive=a, weight_version=v, source="self" if k in self.registered_themselves else "added"
                )
                for k, (a, v) in self.scripted.items()
            ]
        )

    def engines_loading(self) -> list[str]:
        return [node for node in self.loads if self.scripted[node][0]]

    def publish(self, named, version, receiver_roles, announce=True):
        for node in self.engines_loading():
            self.scripted[node] = (True, version)
        return super().publish(named, version, receiver_roles, announce)


def _caught_up(monkeypatch, engines: dict, wait_s: float, during=None) -> tuple[bool, EngineTopology, float]:
    coordinator = EngineTopology(engines)
    coordinator.loads = set(engines)
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    versions = WeightVersions(FakeWeightPublisher(coordinator), torch.nn.Linear(2, 2), run, coordinator, "r", 60.0)
    if during is not None:
        threading.Timer(0.3, during, args=(coordinator,)).start()
    began = time.monotonic()
    ok = versions.catch_up_engines(3, wait_s, poll_s=0.01)
    return ok, coordinator, time.monotonic() - began


def test_engines_already_on_the_last_version_end_the_run_at_once(monkeypatch):
    ok, coordinator, took = _caught_up(monkeypatch, {"e0": (True, 3), "e1": (True, 3)}, wait_s=30)
    assert ok and coordinator.published == [] and took < 10  # not the 30 s bound


def test_an_engine_behind_gets_the_last_version_again_unannounced(monkeypatch):
    ok, coordinator, _ = _caught_up(monkeypatch, {"e0": (True, 3), "e1": (True, 0)}, wait_s=30)
    assert ok
    assert [(p.version, p.announced, p.receiver_roles) for p in coordinator.published] == [(3, False, ["engine"])]


def test_an_engine_that_is_down_is_waited_for_and_caught_up_when_it_returns(monkeypatch):
    back = threading.Event()

    def restarted(coordinator):  # back with its initial weights
        coordinator.scripted["e1"] = (True, 0)
        back.set()

    ok, coordinator, _ = _caught_up(monkeypatch, {"e0": (True, 3), "e1": (False, 2)}, wait_s=30, during=restarted)
    assert ok and back.is_set()  # it waited for the engine to come back rather than ending the run without it
    assert coordinator.scripted["e1"] == (True, 3) and [p.version for p in coordinator.published] == [3]


class LateReports(FakeWeightPublisher):
    """Its sync reports reach the coordinator's record a while after each publish returned, on a thread of their
    own (as WeightPublisher's reporter sends them); `reported` waits for the ones sent so far."""

    def __init__(self, coordinator: EngineTopology, late_s: float):
        super().__init__(coordinator)
        self.topology, self.late_s = coordinator, late_s
        self.reporter = ThreadPoolExecutor(1)

    def publish(self, named, version: int, announce: bool = True):
        loading = [n for n, (alive, _) in self.topology.scripted.items() if alive]
        result = super().publish(named, version, announce)
        self.reporter.submit(self._report, version, loading)
        return result

    def _report(self, version: int, engines: list[str]) -> None:
        time.sleep(self.late_s)
        for node in engines:
            self.topology.scripted[node] = (True, version)

    def reported(self, timeout_s: float | None = None) -> None:
        self.reporter.submit(lambda: None).result(timeout_s)


def test_the_trainer_reads_the_engines_record_only_once_its_own_sync_reports_are_in_it():
    coordinator = EngineTopology({"e0": (True, 2), "e1": (True, 2)})  # no `loads`: only the reports set the record
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    sender = LateReports(coordinator, late_s=0.5)
    versions = WeightVersions(sender, torch.nn.Linear(2, 2), run, coordinator, "r", 60.0)
    assert versions.publish(3) == 3
    assert coordinator.scripted == {"e0": (True, 2), "e1": (True, 2)}  # the report is not in yet
    began = time.monotonic()
    assert versions.catch_up_engines(3, wait_s=30, poll_s=0.01)
    assert len(coordinator.published) == 1 and time.monotonic() - began < 5  # read after the report: no resend
    assert coordinator.scripted == {"e0": (True, 3), "e1": (True, 3)}
    sender.reporter.shutdown()


def test_an_engine_that_joined_during_a_publish_or_said_no_version_is_sent_the_weights_at_the_next_check():
    coordinator = EngineTopology({"e0": (True, 3), "joined": (True, 0), "unsaid": (True, None)})
    coordinator.loads = {"e0", "joined", "unsaid"}
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    versions = WeightVersions(
        FakeWeightPublisher(coordinator), torch.nn.Linear(2, 2), run, coordinator, "r", republish_check_s=0.0
    )
    versions.resend_if_lagging(0)  # nothing published yet: every engine holds the run's initial weights
    assert coordinator.published == []
    versions.resend_if_lagging(3)  # no settling time after a publish: the record is read as it stands
    assert [(p.version, p.announced, p.receiver_roles) for p in coordinator.published] == [(3, False, ["engine"])]
    assert {n: v for n, (_, v) in coordinator.scripted.items()} == {"e0": 3, "joined": 3, "unsaid": 3}
    versions.resend_if_lagging(3)  # all current now: nothing more is sent
    assert len(coordinator.published) == 1


def test_an_engine_that_registered_itself_and_is_gone_is_not_waited_for(monkeypatch):
    coordinator = EngineTopology({"e0": (True, 3), "e1": (False, 2)})
    coordinator.registered_themselves.add("e1")  # a scaled-down pod's registration, lapsed
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    versions = WeightVersions(FakeWeightPublisher(coordinator), torch.nn.Linear(2, 2), run, coordinator, "r", 60.0)
    began = time.monotonic()
    assert versions.catch_up_engines(3, wait_s=30, poll_s=0.01)
    assert time.monotonic() - began < 10 and coordinator.published == []  # not the 30 s bound, nothing resent


def test_an_engine_that_never_returns_ends_the_wait_at_its_bound(monkeypatch):
    ok, coordinator, took = _caught_up(monkeypatch, {"e0": (True, 3), "e1": (False, 2)}, wait_s=0.4)
    assert not ok and 0.4 <= took < 5 and coordinator.published == []


class FlakyTopology(EngineTopology):
    """The coordinator unreachable for its first `failures` topology reads (restarting)."""

    def __init__(self, engines, failures: int):
        super().__init__(engines)
        self.failures = failures

    def engines(self, run_id: str):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("coordinator restarting")
        return super().engines(run_id)


def test_a_coordinator_restarting_at_the_end_is_waited_out_not_raised():
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    coordinator = FlakyTopology({"e0": (True, 0)}, failures=3)
    coordinator.loads = {"e0"}
    versions = WeightVersions(FakeWeightPublisher(coordinator), torch.nn.Linear(2, 2), run, coordinator, "r", 60.0)
    assert versions.catch_up_engines(3, wait_s=30, poll_s=0.01)
    assert coordinator.scripted["e0"] == (True, 3)
    down = FlakyTopology({"e0": (True, 3)}, failures=10**6)  # never answers: the bound ends the wait
    versions = WeightVersions(FakeWeightPublisher(down), torch.nn.Linear(2, 2), run, down, "r", 60.0)
    assert not versions.catch_up_engines(3, wait_s=0.2, poll_s=0.01)


class AnsweringEngine:
    """An engine's health check: answers once the test says it is back."""

    def __init__(self, url: str, back: threading.Event):
        self.base_url, self.back = url, back

    def health(self) -> bool:
        return self.back.is_set()

    def close(self) -> None:
        pass


def test_an_engine_left_out_while_down_gets_the_weights_again_once_it_answers_with_no_step_published():
    # the run's only engine restarted with its initial weights: the rollout waits on it and the trainer on the
    # rollout, so no publish comes; the lag check itself must find it answering again and send it the weights
    back = threading.Event()
    coordinator = EngineTopology({"e0": (True, 0)})
    coordinator.loads = {"e0"}
    sender = FakeWeightPublisher(coordinator)
    with ThreadPoolExecutor(2) as pool:
        sender.unresponsive = UnresponsiveEngines(pool, lambda url: AnsweringEngine(url, back))
        sender.left_out = sender.unresponsive.unanswered
        sender.unresponsive.after_failure({"e0": AnsweringEngine("http://e0", back)})  # the sync while it was down
        run = RunConfig(
            name="r",
            model="/m",
            n_samples_per_prompt=2,
            rollout_batch_size=2,
            global_batch_size=4,
            micro_batch_size=2,
            num_steps=2,
        )
        versions = WeightVersions(sender, torch.nn.Linear(2, 2), run, coordinator, "r", republish_check_s=0.0)
        versions.resend_if_lagging(3)
        time.sleep(0.1)
        versions.resend_if_lagging(3)  # its probe heard nothing: still left out, nothing sent
        assert coordinator.published == [] and sender.left_out() == ["e0"]
        back.set()
        deadline = time.monotonic() + 5
        while not coordinator.published and time.monotonic() < deadline:
            versions.resend_if_lagging(3)
            time.sleep(0.02)
    assert [(p.version, p.announced) for p in coordinator.published] == [(3, False)]
    assert coordinator.scripted["e0"] == (True, 3)


class RefusingPublisher(FakeWeightPublisher):
    """An engine that refuses the weights themselves (422: they do not fit its model) on every publish."""

    def __init__(self, coordinator: InMemoryCoordinator):
        super().__init__(coordinator)
        self.calls = 0

    def publish(self, named, version: int, announce: bool = True):
        from services.dcs.sync.publisher import SyncFailed, SyncResult

        self.calls += 1
        raise SyncFailed(
            SyncResult(
                version=version,
                ok=False,
                refused=True,
                announced=announce,
                error="SGLangError: /end_weight_update: HTTP 422: received lm_head.weight "
                "(1024, 64) torch.float32 does not match the model's (512, 64)",
            )
        )


def test_a_refused_publish_fails_at_once_with_the_engines_message_and_so_does_a_resend():
    coordinator = InMemoryCoordinator()
    sender = RefusingPublisher(coordinator)
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    weights = WeightVersions(sender, torch.nn.Linear(3, 2), run, coordinator, "r", republish_check_s=60.0)
    began = time.monotonic()
    try:
        weights.publish(1)
    except publishing.WeightsRefused as exc:
        assert "lm_head.weight" in str(exc) and "refused" in str(exc)
    else:
        raise AssertionError("a refused publish returned")
    assert sender.calls == 1 and time.monotonic() - began < 1.5  # no retry (the first retry waits 2 s)
    try:  # the engines' catch-up resend meets the same refusal: it fails too, where other failures are retried later
        weights._send_engines(1, ["e1"])
    except publishing.WeightsRefused:
        pass
    else:
        raise AssertionError("a refused resend was swallowed")
    weights.close()


def test_resends_an_engine_answers_with_errors_fail_the_run_after_a_few_and_others_are_retried():
    from services.dcs.sync.publisher import SyncFailed, SyncResult

    class FailingPublisher(FakeWeightPublisher):
        engine_error = True

        def publish(self, named, version: int, announce: bool = True):
            raise SyncFailed(
                SyncResult(
                    version=version,
                    ok=False,
                    engine_error=self.engine_error,
                    error="SGLangError: /end_weight_update: HTTP 500: boom",
                )
            )

    coordinator = InMemoryCoordinator()
    sender = FailingPublisher(coordinator)
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    weights = WeightVersions(sender, torch.nn.Linear(3, 2), run, coordinator, "r", republish_check_s=60.0)
    sender.engine_error = False  # network faults (unreachable engines) are retried at every check, for ever
    for _ in range(publishing.MAX_ENGINE_ERRORS + 2):
        weights._send_engines(1, ["e1"])
    sender.engine_error = True
    for _ in range(publishing.MAX_ENGINE_ERRORS - 1):
        weights._send_engines(1, ["e1"])
    try:
        weights._send_engines(1, ["e1"])
    except RuntimeError as exc:
        assert "in a row" in str(exc) and "HTTP 500: boom" in str(exc)
    else:
        raise AssertionError("an engine failing every resend was retried for ever")
    weights.close()


def test_a_number_a_failed_sync_skipped_does_not_count_as_staleness(monkeypatch):
    from services.dcs.sync.publisher import SyncFailed, SyncResult

    class FailsOnceAfterAnnouncing(FakeWeightPublisher):
        failed = False

        def publish(self, named, version: int, announce: bool = True):
            if not self.failed:
                self.failed = True
                raise SyncFailed(SyncResult(version=version, ok=False, announced=True, error="a receiver died"))
            return super().publish(named, version, announce)

    coordinator = InMemoryCoordinator()
    run = RunConfig(
        name="r",
        model="/m",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
    )
    weights = WeightVersions(
        FailsOnceAfterAnnouncing(coordinator), torch.nn.Linear(3, 2), run, coordinator, "r", republish_check_s=60.0
    )
    monkeypatch.setattr(publishing.time, "sleep", lambda s: None)  # the retry's backoff
    assert weights.publish(2) == 3  # 2 was announced, then failed: the same weights went out as 3
    assert weights.lag(3, 1) == 1 and weights.lag(3, 2) == 0 and weights.lag(4, 1) == 2 and weights.lag(2, 1) == 1
    weights.close()
