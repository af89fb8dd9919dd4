"""SGLang's flattened_bucket form of /update_weights_from_distributed: a publish sends each bucket as one broadcast,
its tensors back to back, to SGLang engines whose version takes it (0.5.6 on), and one broadcast per tensor to a group
with an older one; Sluice's own receivers and the built-in engine take the same broadcasts. The SGLang engines are
the stand-in processes of tests/dcs/sglang_receiver.py, which receive as each release's source does."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.layout import packed_entries, plan_buckets
from services.dcs.sync.publisher import WeightPublisher
from services.runtime.processes import ChildProcess
from services.sglang_protocol.client import FLATTENED_BUCKET_SINCE, SGLangClient, release_at_least
from tests.dcs.sync_worker import digest, wait_for_receivers, weights
from tests.dcs.test_sglang_protocol import _engine, _wait_engines
from tests.worker_fork_server import worker_fork_server


def _published(version: int) -> dict[str, torch.Tensor]:
    """bfloat16 weights, then one of odd length and an int64 tensor: back to back, the int64 one would sit at a
    byte offset SGLang cannot view it at (90246), so it opens a second bucket."""
    named = weights(version, torch.bfloat16)
    named["model.odd.weight"] = torch.arange(3, dtype=torch.bfloat16) + version
    named["model.counts"] = torch.tensor([version, -version], dtype=torch.int64)
    return named


def test_packed_buckets_are_the_layout_sglang_allocates_from_the_names_dtypes_and_shapes():
    named = list(_published(1).items())
    entries, sizes = plan_buckets(named, bucket_bytes=1 << 20, packed=True)
    assert [e.bucket for e in entries] == [0] * 6 + [1] and sizes == [90246, 16]
    for k, size in enumerate(sizes):
        bucket = [e for e in entries if e.bucket == k]
        expected, expected_size = packed_entries(
            [e.name for e in bucket], [e.dtype for e in bucket], [e.shape for e in bucket]
        )
        assert [e.offset for e in bucket] == [e.offset for e in expected] and size == expected_size
    small, small_sizes = plan_buckets(named, bucket_bytes=40_000, packed=True)  # a full bucket starts the next
    assert small_sizes == [32768 + 0, 8192 + 16384 + 128, 32768 + 6, 16]
    assert [e.offset for e in small] == [0, 0, 8192, 24576, 0, 32768, 0]


@pytest.mark.parametrize(
    "version,takes",
    [
        ("0.5.6", True),
        ("0.5.6.post2", True),
        ("0.5.23", True),
        ("0.5.7.dev12+g1a2b3c", True),
        ("1.0", True),
        ("0.5.5", False),
        ("0.5.5.post3", False),
        ("0.5.6rc0", False),
        ("0.5.6.dev3", False),
        ("0.4.10", False),
        ("sluice-0.1.0", False),
        ("", False),
        (None, False),
    ],
)
def test_flattened_bucket_is_taken_from_sglang_0_5_6_on(version, takes):
    assert release_at_least(version, FLATTENED_BUCKET_SINCE) is takes


def _receiver(tmp_path, dcs_url: str, run_id: str, versions: int) -> ChildProcess:
    """One of Sluice's own receivers (actor_fwd) in its own process: it writes each version's digest."""
    return ChildProcess(
        "receiver",
        [
            sys.executable,
            "-m",
            "tests.dcs.sync_worker",
            "receiver",
            "--dcs",
            dcs_url,
            "--run-id",
            run_id,
            "--until",
            str(versions),
            "--timeout-s",
            "20",
            "--out",
            str(tmp_path / "receiver.jsonl"),
        ],
        str(tmp_path / "receiver.log"),
        forker=worker_fork_server(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.5.6", "0.5.23"])
def test_sglang_takes_each_bucket_in_one_broadcast_and_sluices_receiver_the_same(tmp_path, release):
    with LocalDCS(log_dir=str(tmp_path)) as local:
        proc, url = _engine(tmp_path, local.url, "fb", release)
        receiver = _receiver(tmp_path, local.url, "fb", 2)
        try:
            with DCSClient(local.url) as dcs:
                _wait_engines(dcs, "fb", 1)
                wait_for_receivers(dcs, "fb", 1)
                trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="fb"))
                publisher = WeightPublisher(
                    dcs,
                    trainer.node_id,
                    "127.0.0.1",
                    bucket_bytes=1 << 20,
                    timeout_s=20,
                    receiver_roles=["engine", "actor_fwd"],
                    run_id="fb",
                )
                for version in (1, 2):
                    result = publisher.publish(_published(version).items(), version)
                    assert result.ok and result.transfer == "flattened_bucket" and result.world_size == 3
                    assert dcs.latest_weights("fb").transfer == "flat_buckets"  # what receivers take
                    stats = httpx.get(url + "/stats").json()
                    assert stats["digest"] == digest(_published(version)) and stats["version"] == str(version)
                publisher.close()
            assert receiver.proc.wait(60) == 0, receiver.log_tail()
            # per bucket one call and one broadcast: the 6 tensors of bucket 0, then the int64 one
            assert stats["calls"] == [
                {"load_format": "flattened_bucket", "names": n, "broadcasts": 1} for n in (6, 1, 6, 1)
            ]
            received = [json.loads(line) for line in open(tmp_path / "receiver.jsonl")]
            assert [(e["version"], e["digest"]) for e in received if e["event"] == "received"] == [
                (v, digest(_published(v))) for v in (1, 2)
            ]
        finally:
            receiver.stop()
            proc.stop()


@pytest.mark.slow
def test_a_group_with_sglang_before_0_5_6_gets_one_broadcast_per_tensor(tmp_path):
    with LocalDCS(log_dir=str(tmp_path)) as local:
        engines = {release: _engine(tmp_path, local.url, "pt", release) for release in ("0.5.5", "0.5.23")}
        try:
            assert not SGLangClient(engines["0.5.5"][1]).flattened_bucket_update()
            assert SGLangClient(engines["0.5.23"][1]).flattened_bucket_update()
            with DCSClient(local.url) as dcs:
                _wait_engines(dcs, "pt", 2)
                trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="pt"))
                publisher = WeightPublisher(
                    dcs,
                    trainer.node_id,
                    "127.0.0.1",
                    bucket_bytes=1 << 20,
                    timeout_s=20,
                    receiver_roles=["engine"],
                    run_id="pt",
                )
                result = publisher.publish(_published(1).items(), 1)
                assert result.ok and result.transfer == "per_tensor"
                publisher.close()
            for _, url in engines.values():
                stats = httpx.get(url + "/stats").json()
                assert stats["digest"] == digest(_published(1)) and stats["version"] == "1"
                # the 8-byte-aligned layout's one bucket, each of its 7 tensors its own broadcast
                assert stats["calls"] == [{"load_format": None, "names": 7, "broadcasts": 7}]
        finally:
            for proc, _ in engines.values():
                proc.stop()


@pytest.mark.slow
def test_the_builtin_engine_and_sglang_take_one_flattened_broadcast_together(tmp_path):
    """A group mixing the built-in engine (Sluice's flat_bucket, and SGLang's form too) with SGLang 0.5.23 uses the
    form both take: SGLang's, one broadcast per bucket, which the built-in engine loads and serves."""
    from services.model.init_model import init_model
    from tests.engine.conftest import start_engine
    from tests.engine.test_engine_weight_sync import PROMPT, _greedy, _trained_elsewhere

    _, other, expected = _trained_elsewhere(tmp_path)
    named = {n: t.detach() for n, t in other.state_dict().items()}
    builtin, builtin_url = start_engine(
        init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7),
        tmp_path,
        "--weight-sync-timeout-s",
        "20",
    )
    with LocalDCS(log_dir=str(tmp_path)) as local:
        proc, url = _engine(tmp_path, local.url, "mx", "0.5.23")
        try:
            with DCSClient(local.url) as dcs:
                dcs.register(
                    NodeRegistration(
                        role="engine", host="127.0.0.1", run_id="mx", ports={"http": int(builtin_url.rsplit(":", 1)[1])}
                    )
                )
                _wait_engines(dcs, "mx", 1)
                trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="mx"))
                publisher = WeightPublisher(
                    dcs,
                    trainer.node_id,
                    "127.0.0.1",
                    bucket_bytes=1 << 20,
                    timeout_s=20,
                    receiver_roles=["engine"],
                    pause_mode="auto",
                    run_id="mx",
                )
                result = publisher.publish(named.items(), 1)
                publisher.close()
            assert result.ok and result.transfer == "flattened_bucket" and result.world_size == 3
            assert _greedy(builtin_url, PROMPT) == expected and SGLangClient(builtin_url).weight_version() == "1"
            stats = httpx.get(url + "/stats").json()
            assert stats["digest"] == digest(weights(0, torch.float32) | named) and stats["version"] == "1"
            assert stats["calls"] and all(
                c["load_format"] == "flattened_bucket" and c["broadcasts"] == 1 for c in stats["calls"]
            )
        finally:
            proc.stop()
            builtin.stop()
