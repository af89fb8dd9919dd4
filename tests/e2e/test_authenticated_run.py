"""A whole run with the stack's one token, every service its own process: it trains and publishes weights to
the engine (the weight publisher and the rollout send the token), the token is on no process's command line
(the fork server's and the services it forked included),
and every service's HTTP routes but liveness/readiness refuse a request without it."""

from __future__ import annotations

import grpc
import httpx
import pytest

from services.launch.local_run import LocalRun
from services.model.init_model import init_model
from services.run_contract.run_config import RunConfig
from services.runtime.forked_process import ForkedChild
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.errors import TQError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKEN = "run-s3cret-7f3a"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=7)


def every_process(lr: LocalRun) -> dict:
    stack = {"tq-controller": lr.tq.controller, "dcs": lr.dcs.proc, **{p.name: p for p in lr.tq.shards}}
    return {**stack, **lr.procs}


def test_a_run_with_a_token_trains_and_the_token_is_on_no_command_line(model_dir, tmp_path, fork_server):
    run = RunConfig(
        name="authed",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=2,
        rollout={"max_new_tokens": 8},
        optim={"lr": 1e-4},
    )
    with LocalRun(run, log_dir=str(tmp_path), token=TOKEN, forker=fork_server) as lr:
        lr.wait_for_step(run.num_steps, 400)
        procs = every_process(lr)
        assert {"dcs", "tq-controller", "engine-0", "rollout", "advantage", "trainer"} <= set(procs)
        # the engine and the roles were forked from the run's fork server, which has the token in no argv either
        assert all(isinstance(lr.procs[n].proc, ForkedChild) for n in ("engine-0", "rollout", "advantage", "trainer"))
        assert lr.forker is not None
        procs["fork-server"] = lr.forker
        for name, proc in procs.items():
            with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
                assert TOKEN.encode() not in f.read(), name
        # the trainer published to the engine with the token: it serves the last step's weights
        version = lr.progress().version
        assert version >= 1
        engine = lr.engine_urls[0]
        assert httpx.get(engine + "/weight_version", headers=AUTH).json()["weight_version"] == str(version)
        for url, paths in (
            [(engine, ("/metrics", "/weight_version", "/openapi.json", "/docs"))]
            + [
                (lr.procs[r].status_url, ("/status", "/metrics", "/spans", "/openapi.json"))
                for r in ("rollout", "advantage", "trainer")
            ]
            + [(lr.dcs.url, ("/v1/topology", "/metrics", "/openapi.json"))]
        ):
            for path in paths:
                assert httpx.get(url + path).status_code == 401, url + path
                assert httpx.get(url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
                assert httpx.get(url + path, headers=AUTH).status_code == 200, url + path
        assert httpx.get(engine + "/health").status_code == 200
        assert httpx.get(lr.procs["trainer"].status_url + "/healthz").status_code == 200
        assert httpx.get(lr.dcs.url + "/healthz").status_code == 200
        with TransferQueue(lr.tq.controller_address) as anonymous:
            with pytest.raises(TQError) as err:
                anonymous.list_partitions()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
