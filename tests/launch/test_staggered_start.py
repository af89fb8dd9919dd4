"""A staggered start (the default on a machine of a few cores): the rollout starts with the engines, the roles the
first group does not need only once every engine serves, and the run then trains as any other."""

from __future__ import annotations

import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from tests.e2e.run_checks import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class RecordingRun(LocalRun):
    """LocalRun that records when each role is started and each engine found serving."""

    def __init__(self, *args, **kwargs):
        self.events: list[tuple[str, str]] = []
        super().__init__(*args, **kwargs)

    def _wait_engine(self, proc, url):
        super()._wait_engine(proc, url)
        self.events.append(("serving", proc.name))

    def start_role(self, name, wait=True):
        self.events.append(("start", name))
        return super().start_role(name, wait=wait)


def test_staggered_start_defers_the_roles_off_the_first_group_path(tmp_path):
    model = init_model(str(tmp_path / "model"), preset="tiny", arch="qwen2", seed=3)
    run = RunConfig(name="staggered", model=model, max_staleness=1, n_samples_per_prompt=2, rollout_batch_size=2,
                    global_batch_size=4, micro_batch_size=4, num_steps=2, rollout={"max_new_tokens": 8})
    with RecordingRun(run, log_dir=str(tmp_path / "logs"), staggered=True) as local:
        events = local.events
        serving = events.index(("serving", "engine-0"))
        assert events.index(("start", "rollout")) < serving, events
        assert events.index(("start", "trainer")) > serving, events
        assert events.index(("start", "advantage")) > serving, events
        assert not local.deferred_roles
        local.wait_for_step(run.num_steps, 240)
        assert_run_complete(local, run)


def test_an_unstaggered_start_starts_every_role_at_once(tmp_path):
    model = init_model(str(tmp_path / "model"), preset="tiny", arch="qwen2", seed=3)
    run = RunConfig(name="at-once", model=model, n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4,
                    micro_batch_size=4, num_steps=1, rollout={"max_new_tokens": 8})
    with RecordingRun(run, log_dir=str(tmp_path / "logs"), staggered=False) as local:
        events = local.events
        serving = events.index(("serving", "engine-0"))
        assert all(events.index(("start", role)) < serving for role in ("rollout", "trainer", "advantage")), events
        local.wait_for_step(run.num_steps, 240)
