"""A weight update through DCS reaches the built-in engine: outputs and weight_version change; a
failed update leaves the old weights serving."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import NodeRegistration
from services.dcs.sync.publisher import SyncFailed, WeightPublisher
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.sglang_protocol.client import SGLangClient
from tests.engine.conftest import start_engine


pytestmark = pytest.mark.slow  # several processes end to end; ./dev test runs it


def _greedy(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(
        url + "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    )
    return r.json()["output_ids"]


PROMPT = [11, 22, 33]


def _trained_elsewhere(tmp_path):
    """Another model's directory, the model, and its greedy 8 tokens after PROMPT (what the engine must serve
    once those weights reached it)."""
    other_dir = init_model(str(tmp_path / "other"), preset="tiny", arch="qwen2", seed=99)
    other = load_causal_lm(other_dir)[0]
    expected = other.generate(
        torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 3:].tolist()
    return other_dir, other, expected


def _publisher(dcs: DCSClient, engine_url: str, bucket_bytes: int, pause_mode: str) -> WeightPublisher:
    """The engine and a trainer registered with the coordinator; the trainer's publisher."""
    port = int(engine_url.rsplit(":", 1)[1])
    dcs.register(NodeRegistration(role="engine", host="127.0.0.1", ports={"http": port}, run_id="w"))
    trainer = dcs.register(NodeRegistration(role="trainer", host="127.0.0.1", run_id="w"))
    return WeightPublisher(
        dcs,
        trainer.node_id,
        "127.0.0.1",
        bucket_bytes=bucket_bytes,
        timeout_s=20,
        receiver_roles=["engine"],
        pause_mode=pause_mode,
        run_id="w",
    )


def test_weight_update_through_dcs_changes_outputs_and_failure_keeps_old_weights(tiny_model_dir, tmp_path):
    other_dir, other, expected = _trained_elsewhere(tmp_path)
    prompt = PROMPT
    proc, url = start_engine(tiny_model_dir, tmp_path, "--weight-sync-timeout-s", "3")
    try:
        before = _greedy(url, prompt)
        assert before != expected
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            publisher = _publisher(dcs, url, bucket_bytes=100_000, pause_mode="in_place")
            result = publisher.publish(other.state_dict().items(), 1)
            assert result.ok
            assert _greedy(url, prompt) == expected
            assert SGLangClient(url).weight_version() == "1"
            # a request running across an in-place update reports the spans of both versions
            from tests.engine.test_engine import LONG, _Streaming

            crossing = _Streaming(
                url, input_ids=prompt, sampling_params=LONG
            )  # 2000 tokens: still running when the sync pauses it
            assert crossing.started.wait(30)
            assert publisher.publish(other.state_dict().items(), 2).ok
            ids, meta = crossing.result()
            spans = meta["weight_versions"]
            assert [s["version"] for s in spans] == ["1", "2"]
            assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == len(ids)
            # a failed update: the engine is told to receive, nobody sends; it times out
            group = result.group
            r = httpx.post(
                url + "/update_weights_from_distributed",
                json={
                    "names": ["lm_head.weight"],
                    "dtypes": ["float32"],
                    "shapes": [list(other.lm_head.weight.shape)],
                    "group_name": group,
                    "flush_cache": True,
                    "weight_version": "3",
                },
                timeout=60,
            )
            assert r.status_code == 400 and "previous weights keep serving" in r.json()["message"]
            assert _greedy(url, prompt) == expected
            assert SGLangClient(url).weight_version() == "2"
            publisher.close()
        assert proc.stop() == 0  # SIGTERM: clean exit
        assert '"msg": "engine stopped"' in proc.log_tail()
    finally:
        proc.stop()


def test_live_update_keeps_generating_and_wakes_version_long_polls(tiny_model_dir, tmp_path):
    """pause_mode auto on the built-in engine: no pause; a request running across the update keeps going and
    reports both versions; a long poll of /weight_version answers the moment the version moves; a waiting
    long poll does not hold up SIGTERM."""
    import threading
    import time

    other = load_causal_lm(init_model(str(tmp_path / "other"), preset="tiny", arch="qwen2", seed=98))[0]
    proc, url = start_engine(tiny_model_dir, tmp_path)
    try:
        engine = SGLangClient(url)
        assert engine.live_weight_update()
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            publisher = _publisher(dcs, url, bucket_bytes=20_000, pause_mode="auto")
            polled: dict = {}

            def long_poll():
                began = time.monotonic()
                r = httpx.get(url + "/weight_version", params={"newer_than": "default", "wait_s": 60}, timeout=90)
                polled.update(version=r.json()["weight_version"], seconds=time.monotonic() - began)

            poller = threading.Thread(target=long_poll)
            poller.start()
            from tests.engine.test_engine import LONG, _Streaming

            crossing = _Streaming(url, input_ids=[11, 22, 33], sampling_params=LONG)
            assert crossing.started.wait(30)
            result = publisher.publish(other.state_dict().items(), 1)  # several buckets, loaded at once
            assert result.ok and len({e.bucket for e in dcs.weights("w", 1).tensors}) > 1
            poller.join(90)
            assert polled["version"] == "1" and polled["seconds"] < 45  # woken by the update, not the 60 s bound
            ids, meta = crossing.result()
            spans = meta["weight_versions"]
            assert [s["version"] for s in spans] == ["default", "1"]  # never paused: no abort, one request
            assert meta["finish_reason"]["type"] == "length"
            # no pause was recorded by the engine: it generated through the update
            assert not [s for s in httpx.get(url + "/spans").json()["spans"] if s["name"] == "pause"]
            assert (
                _greedy(url, [11, 22, 33])
                == other.generate(
                    torch.tensor([[11, 22, 33]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
                )[0, 3:].tolist()
            )
            publisher.close()
        waiting = threading.Thread(
            target=lambda: httpx.get(url + "/weight_version", params={"newer_than": "1", "wait_s": 60}, timeout=90)
        )
        waiting.start()
        time.sleep(0.5)
        began = time.monotonic()
        assert proc.stop() == 0
        assert time.monotonic() - began < 20  # the long poll answered at shutdown
        waiting.join(30)
    finally:
        proc.stop()


def test_a_bfloat16_engine_takes_float32_weights_at_half_the_bytes_and_refuses_a_mismatch(tiny_model_dir, tmp_path):
    """The precision contract end to end: a bf16 engine declares its dtype, the float32 weights travel in bf16
    (half the bytes) over several buckets (the /begin ... /end bracket) and serve exactly as an engine started
    from those weights in bf16; weights of another shape are refused with 422 naming the tensor, the result
    says no resend can help, and the old weights keep serving."""
    other_dir = init_model(str(tmp_path / "other"), preset="tiny", arch="qwen2", seed=99)
    other = load_causal_lm(other_dir)[0]
    wrong = load_causal_lm(init_model(str(tmp_path / "wrong"), preset="tiny", arch="qwen2", seed=5, vocab_size=512))[0]
    prompt = [11, 22, 33]
    proc, url = start_engine(tiny_model_dir, tmp_path, "--dtype", "bfloat16", "--weight-sync-timeout-s", "5")
    reference, reference_url = start_engine(other_dir, tmp_path, "--dtype", "bfloat16")
    try:
        expected = _greedy(reference_url, prompt)
        assert _greedy(url, prompt) != expected
        with LocalDCS(log_dir=str(tmp_path)) as local, DCSClient(local.url) as dcs:
            publisher = _publisher(dcs, url, bucket_bytes=100_000, pause_mode="auto")
            result = publisher.publish(list(other.named_parameters()), 1)
            fp32_bytes = sum(p.numel() * 4 for p in other.parameters())
            assert result.ok and result.backend == "gloo" and result.wire_dtype == "bfloat16" and result.seconds
            assert fp32_bytes // 2 <= result.bytes < fp32_bytes // 2 + 8 * len(list(other.parameters()))
            assert _greedy(url, prompt) == expected and SGLangClient(url).weight_version() == "1"
            with pytest.raises(SyncFailed) as failed:
                publisher.publish(list(wrong.named_parameters()), 2)
            assert failed.value.result.refused and "model.embed_tokens.weight" in failed.value.result.error
            assert "422" in failed.value.result.error
            assert _greedy(url, prompt) == expected and SGLangClient(url).weight_version() == "1"
            publisher.close()
    finally:
        proc.stop()
        reference.stop()


def test_an_sglang_style_trainer_joins_the_engines_group_and_its_broadcasts_land(tiny_model_dir, tmp_path):
    """A trainer built the way slime, AReaL and verl build theirs (SGLang's init_custom_process_group at rank 0,
    one torch.distributed.broadcast per tensor) updates the built-in engine through SGLang's routes."""
    from concurrent.futures import ThreadPoolExecutor

    from services.runtime.processes import free_port
    from tests.dcs.sglang_receiver import custom_process_group

    _, other, expected = _trained_elsewhere(tmp_path)
    prompt = PROMPT
    proc, url = start_engine(tiny_model_dir, tmp_path, "--weight-sync-timeout-s", "20")
    port = free_port()
    try:
        before = _greedy(url, prompt)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                httpx.post,
                url + "/init_weights_update_group",
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "slime-group",
                    "backend": "gloo",
                },
                timeout=60,
            )
            group = custom_process_group("gloo", "127.0.0.1", port, 0, 2, "slime-group", timeout_s=20)
            assert joined.result().status_code == 200, joined.result().text
            named = list(other.named_parameters())
            update = pool.submit(
                httpx.post,
                url + "/update_weights_from_distributed",
                json={
                    "names": [n for n, _ in named],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                    "shapes": [list(t.shape) for _, t in named],
                    "group_name": "slime-group",
                    "flush_cache": True,
                    "weight_version": "7",
                },
                timeout=60,
            )
            for _, tensor in named:
                torch.distributed.broadcast(tensor.detach().contiguous(), src=0, group=group)
            assert update.result().status_code == 200, update.result().text
            assert _greedy(url, prompt) == expected and SGLangClient(url).weight_version() == "7"
            # SGLang's flattened_bucket: the tensors back to back in one uint8 broadcast (as its
            # FlattenedTensorBucket lays them out), here the starting weights again
            start = load_causal_lm(tiny_model_dir)[0]
            named = [(n, t.detach()) for n, t in start.named_parameters()]
            update = pool.submit(
                httpx.post,
                url + "/update_weights_from_distributed",
                json={
                    "names": [n for n, _ in named],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                    "shapes": [list(t.shape) for _, t in named],
                    "group_name": "slime-group",
                    "load_format": "flattened_bucket",
                    "weight_version": "8",
                },
                timeout=60,
            )
            flat = torch.cat([t.contiguous().flatten().view(torch.uint8) for _, t in named])
            torch.distributed.broadcast(flat, src=0, group=group)
            assert update.result().status_code == 200, update.result().text
        assert _greedy(url, prompt) == before and SGLangClient(url).weight_version() == "8"
        torch.distributed.destroy_process_group(group)
    finally:
        proc.stop()


def test_weights_from_disk_as_areal_sends_them_and_pickles_are_never_read(tiny_model_dir, tmp_path):
    other_dir, other, expected = _trained_elsewhere(tmp_path)
    prompt = PROMPT
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(other.state_dict(), pickled / "pytorch_model.bin")
    proc, url = start_engine(tiny_model_dir, tmp_path)
    try:
        before = _greedy(url, prompt)
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(pickled)}, timeout=60)
        assert r.status_code == 400 and "no .safetensors" in r.json()["message"]
        assert _greedy(url, prompt) == before
        r = httpx.post(
            url + "/update_weights_from_disk",
            json={"model_path": other_dir, "load_format": "auto", "abort_all_requests": False, "weight_version": "d1"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert _greedy(url, prompt) == expected and SGLangClient(url).weight_version() == "d1"
    finally:
        proc.stop()
