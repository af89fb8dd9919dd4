"""The trainer's step reports (services/trainer/step_reports.py) against a real coordinator process and its real
Redis: each recorded step (written as the trainer writes it) reaches `GET /v1/runs/<run>/steps`, through a
coordinator that was down meanwhile and across a trainer that ended with a report undelivered."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import RunConfig
from services.run_state.trainer_progress import TrainerProgress, finish_step
from services.trainer.step_reports import StepReports


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalDCS(log_dir=str(tmp_path_factory.mktemp("dcs"))) as dcs, DCSClient(dcs.url, timeout_s=2) as client:
        store = redis.Redis.from_url(dcs.redis_url, decode_responses=True)
        yield dcs, client, store
        store.close()


@pytest.fixture
def run(stack, uniq):
    name = uniq("reported")
    stack[1].create_run(RunConfig(name=name, model="/models/tiny"))
    return name


def _record(store, run: str, step: int) -> None:
    """Step N done, as the trainer records it (its metrics carry the version published after it)."""
    metrics = {"loss": 1 / (step + 1), "weight_version": step + 1}
    finish_step(store, run, step, [f"{step}:0"], metrics, TrainerProgress(next_step=step + 1, version=step + 1))


def _seen(client, run: str) -> tuple[int, list[tuple[int, float]]]:
    page = client.steps(run)
    return page.next_step, [(r.step, r.metrics["loss"]) for r in page.steps]


def _logged(caplog, text: str) -> bool:
    deadline = time.monotonic() + 10
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in caplog.text


def test_each_step_reaches_the_coordinator_through_its_restart_and_the_trainers(stack, run, caplog):
    caplog.set_level(logging.WARNING, logger="services.trainer.step_reports")
    dcs, client, store = stack
    reports = StepReports(client, store, run, poll_s=0.05)
    for step in range(2):
        _record(store, run, step)
        assert reports.recorded(wait_s=10)
    assert _seen(client, run) == (2, [(0, 1.0), (1, 0.5)])

    dcs.proc.kill()  # the coordinator goes down: the report fails, training goes on, the next report resends it
    _record(store, run, 2)
    assert not reports.recorded(wait_s=0.5)
    assert _logged(caplog, "they are sent again with the next report")
    dcs.start()
    _record(store, run, 3)
    assert reports.recorded(wait_s=20)
    assert _seen(client, run) == (4, [(s, 1 / (s + 1)) for s in range(4)])

    dcs.proc.kill()  # down again as this trainer ends: step 4 is left unreported, and said so
    _record(store, run, 4)
    reports.close(timeout_s=0.5)
    assert "the coordinator did not get the last step reports" in caplog.text
    dcs.start()
    restarted = StepReports(client, store, run, poll_s=0.05)  # the run's next trainer: it resends step 4
    try:
        assert restarted.recorded(wait_s=20)
    finally:
        restarted.close()
    assert _seen(client, run) == (5, [(s, 1 / (s + 1)) for s in range(5)])
    assert client.steps(run).weight_version == 5


def test_a_resumed_trainers_position_is_reported_without_a_step(stack, run):
    _, client, store = stack
    store.set(f"sluice:{run}:trainer:progress", TrainerProgress(next_step=7, version=9).model_dump_json())
    reports = StepReports(client, store, run, poll_s=0.05)  # resumption.py wrote where it resumes: it is polled
    try:
        assert reports.recorded(wait_s=10)
    finally:
        reports.close()
    page = client.steps(run)
    assert (page.next_step, page.weight_version, page.steps) == (7, 9, [])  # steps before a checkpoint: no records
