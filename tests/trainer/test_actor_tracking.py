"""The actor trainer's experiment tracking (services/trainer/tracking_hook.py): through the real trainer against
the in-memory fakes (its steps land in steps.jsonl, TensorBoard and the report), and the hook on its own (what
it adds to a step, completions decoded with the run's tokenizer, evals, failures that never reach training)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import Evaluation, EvaluationStore
from services.role.role_service import RoleStatus
from services.tracking.report import write_report
from services.trainer.config import TrainerConfig
from services.trainer.service import ActorTrainer
from services.trainer.tracking_hook import TrainingTracker
from tests.fakes import FakeRunSession, InMemoryCoordinator, InMemoryDataPlane, InMemoryRedis
from tests.trainer.test_actor_role import RESPONSES, RUN_ID, write_step

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(autouse=True)
def _fresh_trainer_metrics(fresh_trainer_metrics):
    """Every test here may make an ActorTrainer (tests/trainer/conftest.py)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


class AsyncRedisFacade:
    """The in-memory Redis behind the asyncio calls EvaluationStore makes."""

    def __init__(self, redis: InMemoryRedis):
        self.redis = redis

    async def hset(self, key, field, value):
        return self.redis.hset(key, field, value)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_trainer_tracks_each_recorded_step_and_its_completions(model_dir, tmp_path):
    torch.set_num_threads(1)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
        max_staleness=1,
        optim={"lr": 1e-2},
        tracking={"completions_every": 1, "completions_rows": 2},
    )
    initial, _ = load_causal_lm(model_dir, "float32")
    plane, redis, coordinator = InMemoryDataPlane(), InMemoryRedis(), InMemoryCoordinator()
    for step in range(2):
        write_step(plane, step, initial, run.rollout.temperature)
    evaluation = Evaluation(
        version=0,
        mean_reward=0.25,
        pass_at_k=0.5,
        k=1,
        n_prompts=4,
        newest_token_version=0,
        wall_s=1.0,
        finished_at=1.0,
    )
    asyncio.run(EvaluationStore(AsyncRedisFacade(redis), RUN_ID).record(evaluation))  # what the rollout writes
    session = FakeRunSession(run, plane, coordinator=coordinator, redis=redis, run_id=RUN_ID)
    trainer = ActorTrainer(
        TrainerConfig(run_id=RUN_ID, output_dir=str(tmp_path)), RoleStatus("trainer"), publisher=coordinator.publisher
    )
    worker = threading.Thread(target=trainer.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the trainer did not finish the run's steps"

    run_dir = tmp_path / RUN_ID
    assert RunConfig.model_validate_json((run_dir / "run_config.json").read_text()) == run
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [(s["step"], s["weight_version"], s["version_trained"]) for s in steps] == [(0, 1, 0), (1, 2, 1)]
    for s in steps:  # the rows of write_step: rewards 1, 0, 0, 1; response lengths 2, 1, 3, 1
        assert (s["samples"], s["reward_mean"], s["reward_std"]) == (4, 0.5, 0.5)
        assert (s["response_length_mean"], s["response_length_max"]) == (1.75, 3)
        assert s["samples_per_s"] == pytest.approx(4 / s["step_s"])
        assert {
            "loss",
            "entropy",
            "clip_fraction",
            "grad_norm",
            "tokens_per_s",
            "wait_s",
            "compute_s",
            "publish_s",
        } <= set(s)
    assert [(s["staleness_mean"], s["staleness_max"]) for s in steps] == [(0.0, 0), (1.0, 1)]
    assert [s.get("eval") for s in steps] == [evaluation.model_dump(), None]  # the latest eval, once

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    completions = read_jsonl(run_dir / "completions.jsonl")
    assert [(c["step"], c["reward"]) for c in completions] == [(0, 1.0), (0, 0.0), (1, 1.0), (1, 0.0)]
    assert [c["response"] for c in completions[:2]] == [
        tokenizer.decode(r, skip_special_tokens=True) for r in RESPONSES[0]
    ]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 0.5), (1, 0.5)]
    assert json.loads(open(write_report(str(run_dir))["summary"]).read())["steps"] == 2


def test_the_hook_adds_step_time_throughput_staleness_and_new_evals(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt, response = tokenizer.encode("abc"), tokenizer.encode("def")
    batch = {
        "tokens": [torch.tensor(prompt + response + [0, 0])],
        "prompt_length": torch.tensor([len(prompt)]),
        "response_length": torch.tensor([len(response)]),
        "reward": torch.tensor([0.5]),
    }
    evals = iter([None, {"mean_reward": 0.4, "version": 2}, {"mean_reward": 0.4, "version": 2}])
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        tracking={"report_to": ["none"], "completions_every": 2},
    )
    hook = TrainingTracker(run, str(tmp_path), latest_eval=lambda: next(evals))
    for step in range(3):
        hook.offer_samples(step, batch)
        hook.step_finished(step, {"samples": 4, "staleness": {"0": 1, "2": 3}})
    hook.close()
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["samples_per_s"] == pytest.approx(4 / s["step_s"]) and s["staleness_mean"] == 1.5 for s in steps)
    assert [s.get("eval") for s in steps] == [None, {"mean_reward": 0.4, "version": 2}, None]  # once, when new
    assert read_jsonl(tmp_path / "completions.jsonl") == [
        {
            "step": s,
            "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
            "response": tokenizer.decode(response, skip_special_tokens=True),
            "reward": 0.5,
        }
        for s in (0, 2)
    ]


def test_tracking_failures_never_reach_the_trainer(model_dir, tmp_path, caplog):
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        tracking={"report_to": ["none"]},
    )

    def cannot_open(*args):
        raise PermissionError("read-only file system")

    def broken_eval():
        raise ConnectionError("redis went away")

    with caplog.at_level(logging.WARNING, logger="services.trainer.tracking_hook"):
        dead = TrainingTracker(run, str(tmp_path / "a"), open_tracker=cannot_open)
        dead.step_finished(0, {"samples": 1})
        dead.close()
        hook = TrainingTracker(run, str(tmp_path / "b"), latest_eval=broken_eval)
        for step in range(3):
            hook.step_finished(step, {"samples": 1})
        hook.close()
    assert not (tmp_path / "a").exists()
    assert [s["step"] for s in read_jsonl(tmp_path / "b" / "steps.jsonl")] == [0, 1, 2]  # metrics go on
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not start" in m for m in messages) == 1 and sum("eval" in m for m in messages) == 1


def test_a_stuck_backend_never_holds_the_trainer_up(model_dir, tmp_path):
    """step_finished returns while a backend is blocked inside log_metrics; what was queued is written once it
    moves again."""
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        tracking={"report_to": ["none"]},
    )
    entered, release, logged = threading.Event(), threading.Event(), []

    class Stuck:
        def log_metrics(self, step, metrics, wall_time):
            entered.set()
            release.wait()
            logged.append(step)

        def log_completions(self, step, rows):
            pass

        def close(self):
            pass

    hook = TrainingTracker(run, str(tmp_path), open_tracker=lambda *args: Stuck())
    hook.step_finished(0, {"samples": 1})
    assert entered.wait(30)  # the tracking thread is inside the backend, blocked
    for step in (1, 2, 3):
        hook.step_finished(step, {"samples": 1})  # returns at once: the trainer goes on
    assert logged == []
    release.set()
    hook.close()
    assert logged == [0, 1, 2, 3]


def test_busy_fractions_come_from_every_live_service_of_the_run_over_a_window(model_dir, tmp_path, monkeypatch):
    """busy_reader asks the coordinator's topology where the run's services are, reads their spans over HTTP
    (with the token) and divides each one's working seconds by the window; the hook adds them at most once
    per BUSY_WINDOW_S."""
    import http.server
    from types import SimpleNamespace

    from services.trainer import tracking_hook
    from services.trainer.tracking_hook import busy_reader

    seen_tokens = []

    class Spans(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen_tokens.append(self.headers.get("authorization"))
            spans = [
                {"name": "generate", "start": 100.0, "end": 103.0},
                {"name": "pause", "start": 103.0, "end": 110.0},
                {"name": "generate", "start": 108.0, "end": 109.0},
            ]
            body = json.dumps({"spans": spans}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Spans)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from services.dcs.models import NodeInfo

    node = lambda role, run_id, alive=True: NodeInfo(  # noqa: E731 - as the coordinator's topology holds them
        node_id=f"{role}-0",
        role=role,
        rank=0,
        run_id=run_id,
        alive=alive,
        host="127.0.0.1",
        ports={"http": server.server_port},
        registered_at=0.0,
        last_heartbeat=0.0,
    )
    dcs = SimpleNamespace(
        token="s3cret",
        topology=lambda: SimpleNamespace(
            roles={
                "engine": [node("engine", RUN_ID)],
                "rollout": [node("rollout", "another-run")],
                "trainer": [node("trainer", RUN_ID, alive=False)],
            }
        ),
    )
    try:
        busy = busy_reader(dcs, RUN_ID)(100.0, 110.0)
    finally:
        server.shutdown()
    assert busy == {"engine-0": 0.4}  # 3 s + 1 s working of 10 s; pause is waiting; other runs and dead nodes out
    assert seen_tokens == ["Bearer s3cret"]

    monkeypatch.setattr(tracking_hook, "BUSY_WINDOW_S", 0.0)
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        tracking={"report_to": ["none"], "completions_every": 0},
    )
    windows = []
    hook = TrainingTracker(run, str(tmp_path), busy_fractions=lambda t0, t1: windows.append((t0, t1)) or {"x": 0.5})
    for step in range(2):
        hook.step_finished(step, {"samples": 4})
    hook.close()
    assert [s["busy"] for s in read_jsonl(tmp_path / "steps.jsonl")] == [{"x": 0.5}, {"x": 0.5}]
    assert windows[1][0] == windows[0][1]  # back-to-back windows


def test_reward_by_source_is_the_steps_own(model_dir, tmp_path):
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        tracking={"report_to": ["none"], "completions_every": 0},
    )
    asked = []
    hook = TrainingTracker(
        run, str(tmp_path), source_rewards=lambda step: asked.append(step) or ({"math": 0.5 * step} if step else {})
    )
    for step in range(3):
        hook.step_finished(step, {"samples": 4})
    hook.close()
    assert asked == [0, 1, 2]
    assert [s.get("reward_by_source") for s in read_jsonl(tmp_path / "steps.jsonl")] == [
        None,
        {"math": 0.5},
        {"math": 1.0},
    ]
