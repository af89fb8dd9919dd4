"""The trainer backends give the same step: FSDP2 over two real gloo ranks and megatron-core in each layout
against the torch backend in one process, on the same weights and global batch (loss, gradient norm, updated
weights, optimizer state), and a checkpoint written by one backend resumes under the other (fsdp's: the weights
as HF files, the optimizer state in DCP shards); actor_step on two data-parallel ranks is the one-process step.
Every step runs in one pool of ranks (tests/trainer/rank_pool.py, tests/trainer/backend_worker.py), made once
per test run; the tests check its results."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import latest_checkpoint
from services.run_contract.run_config import RunConfig
from services.trainer.actor_update import actor_step
from services.trainer.fsdp_backend import torch_format_optimizer
from tests.trainer.rank_pool import TEST_S, made_once, run_pool
from tests.trainer.test_actor_update import _batch

ATOL, RTOL = 1e-5, 1e-5

# megatron layouts: (TP, PP, ranks, sequence parallelism)
LAYOUTS = {"tp1": (1, 1, 1, 0), "tp2": (2, 1, 2, 0), "pp2": (1, 2, 2, 0), "dp2": (1, 1, 2, 0), "tp2pp2sp": (2, 2, 4, 1)}
RESUMED = ("tp2pp2sp", "tp1", "dp2")  # layouts that also resume a second step (CI time: the others share code)

pytestmark = [
    pytest.mark.timeout(TEST_S),
    pytest.mark.one_worker,
]  # the pool's set-up, or the wait for another worker's


def _case(
    name: str,
    backend: str,
    size: int = 1,
    model: str = "qwen2",
    seed: int = 0,
    resume: str = "",
    tp: int = 1,
    pp: int = 1,
    sp: int = 0,
    lora: int = 0,
) -> dict:
    """One step of `backend` on `size` ranks (backend_worker.run_case); `resume`: the case whose checkpoint it
    starts from."""
    return dict(
        name=name, backend=backend, size=size, model=model, seed=seed, resume=resume, tp=tp, pp=pp, sp=sp, lora=lora
    )


def plan() -> list[dict]:
    """Every case of this module, for one pool of ranks. torch's and fsdp's come first: megatron's CPU shim,
    once a rank has built a megatron model, patches torch in that process, and the other backends must run as
    they do in a trainer without it. Then megatron's, widest layout first."""
    cases = [
        _case("torch-qwen2", "torch"),
        _case("torch-qwen2-again", "torch", seed=1, resume="torch-qwen2"),
        _case("torch-llama", "torch", model="llama"),
        _case("torch-lora", "torch", lora=1),
        _case("torch-lora-again", "torch", seed=1, resume="torch-lora", lora=1),
        _case("dp-sgd", "actor_step", 2, model="llama"),
        _case("fsdp-llama", "fsdp", 2, model="llama"),
        _case("fsdp-qwen2", "fsdp", 2),
        _case("fsdp-qwen2-from-torch", "fsdp", 2, seed=1, resume="torch-qwen2"),
        _case("fsdp-qwen2-from-fsdp", "fsdp", 2, seed=1, resume="fsdp-qwen2"),
        _case("fsdp-lora", "fsdp", 2, lora=1),
        _case("torch-qwen2-from-fsdp", "torch", seed=1, resume="fsdp-qwen2"),
        _case("torch-lora-from-fsdp", "torch", seed=1, resume="fsdp-lora", lora=1),
    ]
    for layout, (tp, pp, size, sp) in sorted(LAYOUTS.items(), key=lambda kv: -kv[1][2]):
        cases.append(_case(f"megatron-{layout}", "megatron", size, tp=tp, pp=pp, sp=sp))
        if layout in RESUMED:
            cases.append(
                _case(
                    f"megatron-{layout}-again",
                    "megatron",
                    size,
                    seed=1,
                    resume=f"megatron-{layout}",
                    tp=tp,
                    pp=pp,
                    sp=sp,
                )
            )
    return cases


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """The directory of every case's results (pool/<case>/: step.json, weights.safetensors, the checkpoint under
    actor/), made once per test run by one pool of four real gloo ranks; the models under pool/models/<arch>."""

    def make(directory):
        for arch in ("qwen2", "llama"):
            init_model(str(directory / "models" / arch), preset="tiny", arch=arch, seed=7)
        run_pool("tests.trainer.backend_worker", plan(), directory)

    return made_once(tmp_path_factory, "trainer-backends", make)


def _same_step(a: str, b: str) -> None:
    sa, sb = (json.load(open(f"{d}/step.json")) for d in (a, b))
    assert sa["loss"] == pytest.approx(sb["loss"], abs=ATOL, rel=RTOL)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], abs=ATOL, rel=RTOL)
    wa, wb = (load_file(f"{d}/weights.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fsdp_two_ranks_take_the_torch_step_and_checkpoints_cross_backends(pool, arch):
    single, sharded = str(pool / f"torch-{arch}"), str(pool / f"fsdp-{arch}")
    _same_step(single, sharded)
    # fsdp's checkpoint: the HF weights written file by file, the optimizer state sharded (DCP), equal to torch's
    ca, cb = (latest_checkpoint(d, "actor").path for d in (single, sharded))
    assert not os.path.exists(f"{cb}/optimizer.pt") and os.path.isfile(f"{cb}/sharded/.metadata")
    model = load_causal_lm(str(pool / "models" / arch))[0]
    names = [n for n, _ in model.named_parameters()]
    oa, ob = torch.load(f"{ca}/optimizer.pt", weights_only=True), torch_format_optimizer(f"{cb}/sharded", names)
    assert (
        oa["state"].keys() == ob["state"].keys() and oa["param_groups"][0]["params"] == ob["param_groups"][0]["params"]
    )
    for k in oa["state"]:
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(oa["state"][k][moment], ob["state"][k][moment], atol=ATOL, rtol=RTOL)
    for name, t in load_file(f"{ca}/model.safetensors").items():
        torch.testing.assert_close(t, load_file(f"{cb}/model.safetensors")[name], atol=ATOL, rtol=RTOL)
    if model.config.model_type != "qwen2":
        return  # CI time: resuming is the same code for both architectures
    # a second step from either checkpoint, under either backend, is the torch backend's from its own
    torch_again = str(pool / "torch-qwen2-again")
    for resumed in ("fsdp-qwen2-from-torch", "fsdp-qwen2-from-fsdp", "torch-qwen2-from-fsdp"):
        _same_step(torch_again, str(pool / resumed))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_takes_the_torch_step(pool, layout):
    """megatron-core's model, schedules and DistributedOptimizer (CPU, gloo) against the torch backend: the same
    loss, gradient norm and updated weights (gathered from the shards back into HF names; TP=2 x PP=2 with
    sequence parallelism, its sequences padded to a multiple of TP). Qwen2 only (QKV biases; Llama's layout is
    the same without them, and test_megatron_cpu checks its logits)."""
    single, sharded = str(pool / "torch-qwen2"), str(pool / f"megatron-{layout}")
    _same_step(single, sharded)
    # its checkpoint: the HF export of the weights and megatron's own shards; a second step resumed from it is
    # the torch backend's second step
    cm = latest_checkpoint(sharded, "actor").path
    assert os.path.isdir(f"{cm}/sharded") and not os.path.exists(f"{cm}/optimizer.pt")
    for name, t in load_file(f"{cm}/model.safetensors").items():
        torch.testing.assert_close(t, load_file(f"{single}/weights.safetensors")[name], atol=ATOL, rtol=RTOL)
    if layout in RESUMED:
        _same_step(str(pool / "torch-qwen2-again"), str(pool / f"megatron-{layout}-again"))


def test_fsdp_lora_two_ranks_take_the_torch_lora_step_and_resume_under_torch(pool):
    """trainer.lora under FSDP2: the adapter of two sharded ranks after a step is the torch backend's, its
    checkpoint is peft's files (no full weights) and a torch trainer resumes from it as from its own."""
    single, sharded = str(pool / "torch-lora"), str(pool / "fsdp-lora")
    _same_step(single, sharded)
    sent = load_file(f"{sharded}/weights.safetensors")
    assert sent and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in sent)
    ca, cb = (latest_checkpoint(d, "actor").path for d in (single, sharded))
    model_dir = str(pool / "models" / "qwen2")
    for ckpt in (ca, cb):
        assert os.path.isfile(f"{ckpt}/adapter_model.safetensors") and os.path.isfile(f"{ckpt}/adapter_config.json")
        assert not os.path.exists(f"{ckpt}/model.safetensors")
        assert json.load(open(f"{ckpt}/adapter_config.json"))["base_model_name_or_path"] == model_dir
        for name, t in load_file(f"{ca}/adapter_model.safetensors").items():
            torch.testing.assert_close(load_file(f"{ckpt}/adapter_model.safetensors")[name], t, atol=ATOL, rtol=RTOL)
    # a torch trainer resumed from each checkpoint takes the same second step
    _same_step(str(pool / "torch-lora-again"), str(pool / "torch-lora-from-fsdp"))


def test_two_data_parallel_ranks_take_the_one_process_step(pool):
    """actor_step on two data-parallel ranks, their gradients summed by DataParallel, against one process: with
    plain SGD the updated weights are the gradients themselves (backend_worker.sgd_step)."""
    model_dir = str(pool / "models" / "llama")
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=1,
        optim={"lr": 1e-3, "grad_clip": 1e9},
    )
    model, _ = load_causal_lm(model_dir)
    actor_step(model, torch.optim.SGD(model.parameters(), lr=1e-2), _batch(), run, 4)
    got = load_file(str(pool / "dp-sgd" / "weights.safetensors"))
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.detach(), atol=1e-6, rtol=1e-5)
