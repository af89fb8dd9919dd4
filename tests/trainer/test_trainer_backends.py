"""The trainer backends give the same step: FSDP2 over two real gloo ranks against the torch backend in one
process, on the same weights and global batch (loss, gradient norm, updated weights, optimizer state), and a
checkpoint written by one backend resumes under the other (fsdp's: the weights as HF files, the optimizer state
in DCP shards)."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from services.runtime.processes import ChildProcess, free_port
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import latest_checkpoint
from services.trainer.data_parallel import DataParallel
from services.trainer.fsdp_backend import torch_format_optimizer
from tests.trainer.backend_worker import train_once

ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module", params=[("tiny", "llama"), ("tiny", "qwen2")], ids=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    preset, arch = request.param
    return init_model(str(tmp_path_factory.mktemp("m")), preset=preset, arch=arch, seed=7)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("q")), preset="tiny", arch="qwen2", seed=7)


def _ranks(tmp_path, name: str, backend: str, model: str, seed: int, resume: str = "", size: int = 2,
           tp: int = 1, pp: int = 1, sp: bool = False, lora: bool = False) -> str:
    out = tmp_path / name
    master = f"127.0.0.1:{free_port()}"
    argv = ["--model", model, "--backend", backend, "--size", str(size), "--master", master, "--out", str(out),
            "--seed", str(seed), "--tp", str(tp), "--pp", str(pp), "--sp", str(int(sp)),
            "--lora", str(int(lora))] + \
        (["--resume", resume] if resume else [])
    procs = [ChildProcess(f"{name}-{r}", [sys.executable, "-m", "tests.trainer.backend_worker", *argv,
                                          "--rank", str(r)], str(tmp_path / f"{name}-{r}.log")) for r in range(size)]
    assert [p.proc.wait(180) for p in procs] == [0] * size, [p.log_tail() for p in procs]
    return str(out)


def _same_step(a: str, b: str) -> None:
    sa, sb = (json.load(open(f"{d}/step.json")) for d in (a, b))
    assert sa["loss"] == pytest.approx(sb["loss"], abs=ATOL, rel=RTOL)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], abs=ATOL, rel=RTOL)
    wa, wb = (load_file(f"{d}/weights.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=ATOL, rtol=RTOL)


def test_fsdp_two_ranks_take_the_torch_step_and_checkpoints_cross_backends(model_dir, tmp_path):
    single = str(tmp_path / "torch")
    train_once("torch", model_dir, DataParallel(), single)
    sharded = _ranks(tmp_path, "fsdp", "fsdp", model_dir, seed=0)
    _same_step(single, sharded)
    # fsdp's checkpoint: the HF weights written file by file, the optimizer state sharded (DCP), equal to torch's
    ca, cb = (latest_checkpoint(d, "actor").path for d in (single, sharded))
    assert not os.path.exists(f"{cb}/optimizer.pt") and os.path.isfile(f"{cb}/sharded/.metadata")
    model = load_causal_lm(model_dir)[0]
    names = [n for n, _ in model.named_parameters()]
    oa, ob = torch.load(f"{ca}/optimizer.pt", weights_only=True), torch_format_optimizer(f"{cb}/sharded", names)
    assert oa["state"].keys() == ob["state"].keys() and oa["param_groups"][0]["params"] == ob["param_groups"][0]["params"]
    for k in oa["state"]:
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(oa["state"][k][moment], ob["state"][k][moment], atol=ATOL, rtol=RTOL)
    for name, t in load_file(f"{ca}/model.safetensors").items():
        torch.testing.assert_close(t, load_file(f"{cb}/model.safetensors")[name], atol=ATOL, rtol=RTOL)
    if model.config.model_type != "qwen2":
        return  # CI time: resuming is the same code for both architectures
    # a second step from either checkpoint, under either backend, is the torch backend's from its own
    torch_again = str(tmp_path / "torch2")
    train_once("torch", model_dir, DataParallel(), torch_again, resume=ca, seed=1)
    _same_step(torch_again, _ranks(tmp_path, "fsdp2", "fsdp", model_dir, seed=1, resume=ca))
    _same_step(torch_again, _ranks(tmp_path, "fsdp3", "fsdp", model_dir, seed=1, resume=cb))
    torch_from_fsdp = str(tmp_path / "torch3")
    train_once("torch", model_dir, DataParallel(), torch_from_fsdp, resume=cb, seed=1)
    _same_step(torch_again, torch_from_fsdp)


RESUMED = {(1, 1, 1), (1, 1, 2), (2, 2, 4)}  # layouts that also resume a second step (CI time: the others share code)


@pytest.mark.parametrize("tp,pp,size,sp", [(1, 1, 1, 0), (2, 1, 2, 0), (1, 2, 2, 0), (1, 1, 2, 0), (2, 2, 4, 1)],
                         ids=["tp1", "tp2", "pp2", "dp2", "tp2pp2sp"])
def test_megatron_takes_the_torch_step(qwen2_dir, tmp_path, tp, pp, size, sp):
    """megatron-core's model, schedules and DistributedOptimizer (CPU, gloo) against the torch backend: the same
    loss, gradient norm and updated weights (gathered from the shards back into HF names; TP=2 x PP=2 with
    sequence parallelism, its sequences padded to a multiple of TP). Qwen2 only (QKV biases; Llama's layout is
    the same without them, and test_megatron_cpu checks its logits)."""
    model_dir = qwen2_dir
    single = str(tmp_path / "torch")
    train_once("torch", model_dir, DataParallel(), single)
    sharded = _ranks(tmp_path, "megatron", "megatron", model_dir, seed=0, size=size, tp=tp, pp=pp, sp=sp)
    _same_step(single, sharded)
    # its checkpoint: the HF export of the weights and megatron's own shards; a second step resumed from it is
    # the torch backend's second step
    cm = latest_checkpoint(sharded, "actor").path
    assert os.path.isdir(f"{cm}/sharded") and not os.path.exists(f"{cm}/optimizer.pt")
    for name, t in load_file(f"{cm}/model.safetensors").items():
        torch.testing.assert_close(t, load_file(f"{single}/weights.safetensors")[name], atol=ATOL, rtol=RTOL)
    if (tp, pp, size) not in RESUMED:
        return
    torch_again = str(tmp_path / "torch2")
    train_once("torch", model_dir, DataParallel(), torch_again, resume=latest_checkpoint(single, "actor").path, seed=1)
    _same_step(torch_again, _ranks(tmp_path, "megatron2", "megatron", model_dir, seed=1, size=size, tp=tp, pp=pp,
                                   sp=sp, resume=cm))


def test_fsdp_lora_two_ranks_take_the_torch_lora_step_and_resume_under_torch(qwen2_dir, tmp_path):
    """trainer.lora under FSDP2: the adapter of two sharded ranks after a step is the torch backend's, its
    checkpoint is peft's files (no full weights) and a torch trainer resumes from it as from its own."""
    single = str(tmp_path / "torch")
    train_once("torch", qwen2_dir, DataParallel(), single, lora=True)
    sharded = _ranks(tmp_path, "fsdp", "fsdp", qwen2_dir, seed=0, lora=True)
    _same_step(single, sharded)
    sent = load_file(f"{sharded}/weights.safetensors")
    assert sent and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in sent)
    ca, cb = (latest_checkpoint(d, "actor").path for d in (single, sharded))
    for ckpt in (ca, cb):
        assert os.path.isfile(f"{ckpt}/adapter_model.safetensors") and os.path.isfile(f"{ckpt}/adapter_config.json")
        assert not os.path.exists(f"{ckpt}/model.safetensors")
        assert json.load(open(f"{ckpt}/adapter_config.json"))["base_model_name_or_path"] == qwen2_dir
        for name, t in load_file(f"{ca}/adapter_model.safetensors").items():
            torch.testing.assert_close(load_file(f"{ckpt}/adapter_model.safetensors")[name], t, atol=ATOL, rtol=RTOL)
    again = [str(tmp_path / f"again-{k}") for k in range(2)]
    for ckpt, out in zip((ca, cb), again):
        train_once("torch", qwen2_dir, DataParallel(), out, resume=ckpt, seed=1, lora=True)
    _same_step(*again)
