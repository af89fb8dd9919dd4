"""The trainer drives SGLang-protocol engines through a weight sync, for each release's quirks,
against stand-in receiver processes (tests/dcs/sglang_receiver.py), next to one of our own receivers."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import SyncFailed, WeightPublisher
from services.sglang_protocol.client import SGLangClient
from services.runtime.processes import ChildProcess, free_port, http_ok
from tests.dcs.sync_worker import digest, weights
from tests.worker_fork_server import worker_fork_server


pytestmark = pytest.mark.slow  # several processes end to end; ./dev test runs it


def _engine(tmp_path, dcs_url, run_id, release, *extra) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess(
        f"engine-{release}",
        [
            sys.executable,
            "-m",
            "tests.dcs.sglang_receiver",
            "--port",
            str(port),
            "--dcs",
            dcs_url,
            "--run-id",
            run_id,
            "--release",
            release,
            *extra,
        ],
        str(tmp_path / f"engine-{release}-{port}.log"),
        forker=worker_fork_server(),
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/stats"), 60)
    return proc, url


def _wait_engines(dcs: DCSClient, run_id: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while sum(e.alive for e in dcs.topology().roles.get("engine", []) if e.run_id == run_id) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engines_of_every_release_get_the_weights_and_version(tmp_path, dtype):
    with LocalDCS(log_dir=str(tmp_path)) as local:
        engines = [_engine(tmp_path, local.url, "r", release) for release in ("0.5.5", "0.5.6", "0.5.23")]
        try:
            with DCSClient(local.url) as dcs:
                _wait_engines(dcs, "r", 3)
                trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="r"))
                publisher = WeightPublisher(
                    dcs,
                    trainer.node_id,
                    "127.0.0.1",
                    bucket_bytes=50_000,
                    timeout_s=20,
                    receiver_roles=["engine"],
                    pause_mode="retract",
                    run_id="r",
                )
                for version in (1, 2):
                    tensors = weights(version, dtype)
                    result = publisher.publish(tensors.items(), version)
                    assert result.ok and result.world_size == 4
                    for _, url in engines:
                        stats = httpx.get(url + "/stats").json()
                        assert stats["digest"] == digest(tensors) and stats["version"] == str(version)
                        assert SGLangClient(url).weight_version() == str(version)
                publisher.close()  # sends the reports still queued
                group_names = {r.group for r in dcs.sync_reports("r", 10)}
                assert len(group_names) == 1  # the group was initialised once and reused
            stats = {url: httpx.get(url + "/stats").json() for _, url in engines}
            assert stats[engines[0][1]]["pauses"] == ["abort", "abort"]  # 0.5.5 cannot retract
            assert stats[engines[1][1]]["pauses"] == ["retract", "retract"]
            assert all(s["continues"] == 2 and s["updates"] >= 2 for s in stats.values())
        finally:
            for proc, _ in engines:
                proc.stop()


@pytest.mark.parametrize("release", ["0.5.6", "0.5.23"])
def test_failed_engine_update_fails_the_sync_and_generation_still_continues(tmp_path, release):
    """...and the next sync works: with 0.5.23, only because the failed one still sent /end_weight_update."""
    with LocalDCS(log_dir=str(tmp_path)) as local:
        proc, url = _engine(tmp_path, local.url, "f", release, "--fail-version", "2")
        try:
            with DCSClient(local.url) as dcs:
                _wait_engines(dcs, "f", 1)
                trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="f"))
                publisher = WeightPublisher(
                    dcs, trainer.node_id, "127.0.0.1", timeout_s=20, receiver_roles=["engine"], run_id="f"
                )
                publisher.publish(weights(1, torch.float32).items(), 1)
                with pytest.raises(SyncFailed) as err:
                    publisher.publish(weights(2, torch.float32).items(), 2)
                assert "partially written" in str(err.value)
                stats = httpx.get(url + "/stats").json()
                assert stats["continues"] == 2  # continue_generation ran in the finally
                assert stats["serving"] is False and stats["version"] == "1"
                result = publisher.publish(weights(3, torch.float32).items(), 3)  # a new group, and it works
                assert result.ok
                stats = httpx.get(url + "/stats").json()
                assert stats["serving"] is True and stats["version"] == "3"
                assert stats["digest"] == digest(weights(3, torch.float32))
                publisher.close()  # sends the reports still queued
                assert len({r.group for r in dcs.sync_reports("f", 10)}) == 2
        finally:
            proc.stop()


def test_a_paused_sglang_server_counts_as_alive(tmp_path):
    """SGLang holds /health for its 20 s probe while paused and then answers 503: the publisher's liveness check
    (after a failed sync) must not take such a server for a hung one."""
    with LocalDCS(log_dir=str(tmp_path)) as local:
        proc, url = _engine(tmp_path, local.url, "r", "0.5.6")
        try:
            client = SGLangClient(url)
            client.pause("abort")
            began = time.monotonic()
            assert client.health() and time.monotonic() - began < 5
            client.close()
        finally:
            proc.stop()
        assert not SGLangClient(url).health()  # gone: no answer


def test_the_version_route_is_found_on_the_event_loop_even_when_every_worker_thread_is_busy(tmp_path):
    """A rollout whose worker threads are all held (its agents' episodes, each blocked on a model call while no engine
    answers) must still find its engine's version route: the discovery runs on the event loop, not in a thread.
    SGLang 0.5.5 answers it on /get_weight_version (/weight_version is a 404 there)."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with LocalDCS(log_dir=str(tmp_path)) as local:
        proc, url = _engine(tmp_path, local.url, "r", "0.5.5")
        release = threading.Event()

        async def discover() -> str:
            loop = asyncio.get_running_loop()
            loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
            held = loop.run_in_executor(None, release.wait)  # the only worker thread, busy
            client = SGLangClient(url)
            try:
                return await asyncio.wait_for(client.wait_weight_version(None, 0), 20)
            finally:
                release.set()
                await held
                await client.aclose()
                client.close()

        try:
            assert asyncio.run(discover()) == "default"
        finally:
            release.set()
            proc.stop()
