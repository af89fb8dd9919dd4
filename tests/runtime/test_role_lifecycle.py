"""serve_role (services/role/role_service.py) against a real coordinator process: a role's fatal error and a
failed preflight become the run's failure, and a run that fails or is stopped ends every role's loop."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from services.dcs.client import DCSError
from services.dcs.models import RunConfig
from services.role.role_service import PreflightFailed, RoleSettings, RoleStatus, serve_role
from services.transferqueue.errors import TQError

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture
def run_id(client, uniq):
    name = uniq("run")
    client.create_run(RunConfig(name=name, model="/nowhere/model"))
    return name


def settings(dcs, run_id: str) -> RoleSettings:
    return RoleSettings(run_id=run_id, dcs_url=dcs.url, host="127.0.0.1", port=0)


async def serve(dcs, run_id: str, role: str, loop=None, aloop=None, stop: asyncio.Event | None = None):
    status = RoleStatus(role)
    await serve_role(settings(dcs, run_id), stop or asyncio.Event(), status, loop=loop, aloop=aloop, watch_poll_s=0.1)
    return status


async def test_the_loop_is_given_the_run_session_the_host_opened(dcs, client, run_id):
    """One coordinator client (the host's, which also watches the run) and the run's config as the host read it;
    each client is made once, whichever thread asks first."""
    seen = {}

    def loop(session, halt: threading.Event) -> None:
        seen["run"] = session.run.name
        seen["steps_on_its_tq"] = session.steps.tq is session.tq  # the step walker is made over the same client
        seen["made_once"] = session.redis is session.redis and session.tq is session.tq
        seen["status"] = session.dcs.run(run_id).status  # the host's client, called from the loop's thread
        client.stop_run(run_id)  # the loop is done; the host then exits with the run

    status = await asyncio.wait_for(serve(dcs, run_id, "advantage", loop=loop), 60)
    assert seen == {"run": run_id, "steps_on_its_tq": True, "made_once": True, "status": "running"}
    assert status.snapshot()["state"] == "stopped"


async def test_a_loop_that_raises_fails_the_run_and_the_process(dcs, client, run_id):
    def loop(session, halt: threading.Event) -> None:
        raise ValueError("advantage of a group with no rewards")

    with pytest.raises(ValueError):
        await serve(dcs, run_id, "advantage", loop=loop)
    failure = client.status(run_id).failure
    assert client.run(run_id).status == "failed" and failure.role == "advantage"
    assert (
        failure.message.startswith("ValueError: advantage of a group with no rewards (at ")
        and "test_role_lifecycle" in failure.message
    )


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("shard 3 went away"),
        TQError(grpc.StatusCode.UNAVAILABLE, "Stream removed"),
        DCSError(503, "state store unreachable"),
    ],
    ids=type,
)
async def test_a_loop_that_loses_a_dependency_exits_without_failing_the_run(dcs, client, run_id, error):
    """A service it needs is restarting: the role goes down to be restarted, the run goes on."""

    def loop(session, halt: threading.Event) -> None:
        raise RuntimeError("the step failed") from error

    with pytest.raises(RuntimeError):
        await serve(dcs, run_id, "advantage", loop=loop)
    assert client.run(run_id).status == "running" and client.status(run_id).failure is None


async def test_a_failed_preflight_fails_the_run_before_the_loop_starts(dcs, client, run_id):
    started = []
    with pytest.raises(PreflightFailed, match="model"):
        await serve(dcs, run_id, "trainer", loop=started.append)
    failure = client.run(run_id).failure
    assert not started and failure.role == "trainer"
    assert failure.message.startswith("preflight: model: ") and "/nowhere/model" in failure.message


@pytest.mark.parametrize("end", ["stop", "fail"])
async def test_a_waiting_thread_loop_exits_cleanly_when_the_run_ends(dcs, client, run_id, end):
    waiting = threading.Event()

    def loop(session, halt: threading.Event) -> None:  # a role waiting for rows that will never come
        waiting.set()
        halt.wait()

    serving = asyncio.create_task(serve(dcs, run_id, "advantage", loop=loop))
    assert await asyncio.to_thread(waiting.wait, 30)
    if end == "stop":
        await asyncio.to_thread(client.stop_run, run_id)
    else:
        await asyncio.to_thread(client.fail_run, run_id, "rollout", "the reward server is gone")
    role_status = await asyncio.wait_for(serving, 60)  # returns: the process exits 0
    assert role_status.snapshot()["state"] == ("stopped" if end == "stop" else "failed")
    if end == "fail":  # the first failure stays the run's, and this role, which did not fail, added none
        status = client.status(run_id)
        assert status.failure.role == "rollout" and status.later_failures == []


async def test_an_async_loop_is_stopped_too(dcs, client, run_id):
    async def aloop(session, stop: asyncio.Event) -> None:
        await asyncio.to_thread(client.stop_run, run_id)
        await stop.wait()

    status = await asyncio.wait_for(serve(dcs, run_id, "advantage", aloop=aloop), 60)
    assert status.snapshot()["state"] == "stopped"


async def test_a_role_started_after_the_run_ended_does_not_start_its_loop(dcs, client, run_id):
    client.stop_run(run_id)
    started = []
    status = await asyncio.wait_for(serve(dcs, run_id, "advantage", loop=started.append), 60)
    assert not started and status.snapshot()["state"] == "stopped"


async def test_a_finished_loop_keeps_serving_until_sigterm(dcs, client, run_id):
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(dcs, run_id, "advantage", loop=lambda session, halt: None, stop=stop))
    await asyncio.to_thread(client.finish_run, run_id)
    await asyncio.sleep(0.5)  # several polls of the run: finished is not a reason to exit
    assert not serving.done()
    stop.set()
    assert (await asyncio.wait_for(serving, 30)).snapshot()["state"] == "finished"


async def test_a_run_outside_the_operators_policy_fails_before_its_reward_is_imported(dcs, client, uniq, tmp_path):
    """--allow-reward-modules: a run whose reward names another module fails at the rollout's start, naming the
    rule, and the module's top level never runs (it would leave a file behind)."""
    module = tmp_path / "sneaky_reward.py"
    marker = tmp_path / "imported"
    module.write_text(f"open({str(marker)!r}, 'w').close()\ndef score(response, fields, prompt):\n    return 1.0\n")
    name = uniq("policy")
    client.create_run(
        RunConfig(
            name=name,
            model="/nowhere/model",
            rollout={"prompts": "demo:reverse", "reward": "import:sneaky_reward:score"},
        )
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        config = RoleSettings(
            run_id=name, dcs_url=dcs.url, host="127.0.0.1", port=0, allow_reward_modules="trusted_rewards"
        )
        with pytest.raises(PreflightFailed, match="allowed reward modules"):
            await serve_role(
                config, asyncio.Event(), RoleStatus("rollout"), loop=lambda session, halt: None, watch_poll_s=0.1
            )
    finally:
        sys.path.remove(str(tmp_path))
    assert not marker.exists()
    failure = client.run(name).failure
    assert failure.role == "rollout" and "rollout.reward: module 'sneaky_reward'" in failure.message
