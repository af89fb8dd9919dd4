"""The megatron-core ranks of test_megatron_cpu, a pool of them (tests/trainer/rank_pool.py) running its plan's
cases: `shim`, the CPU shim's checks (first, in a rank that has not installed it yet: the shim patches torch for
the whole process), and per model and layout, this rank's GPTModel built from the HF config (tensor and pipeline
parallel over gloo), loaded with its shard of the HF weights, run forward, and (the last stage's tensor rank 0)
its full-vocabulary logits saved."""

import os
import pathlib
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from services.trainer.data_parallel import DataParallel
from tests.trainer.rank_pool import WAIT_S, serve

warnings.filterwarnings("ignore", message="Apex is not installed")


def check_shim() -> None:
    import importlib

    from services.trainer import megatron_cpu

    assert megatron_cpu.installed_version() == megatron_cpu.MEGATRON_CORE_VERSION, (
        "megatron-core moved: check services/trainer/megatron_cpu.py against it, then move the pin"
    )
    assert megatron_cpu.install() is True  # no CUDA here
    for (module_name, attr), replacement in megatron_cpu.REDIRECTS.items():
        assert getattr(importlib.import_module(module_name), attr) is replacement, f"{module_name}.{attr}"
    for module_name in megatron_cpu.DEVICE_MODULES:
        module = importlib.import_module(module_name)
        assert isinstance(module.torch, megatron_cpu._TorchOnCPU), module_name
        assert module.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    x = torch.zeros(2)
    assert x.cuda() is x and x.type() == "torch.cuda.FloatTensor" and x.long().type() == "torch.LongTensor"
    assert x.type(torch.float64).dtype == torch.float64
    installed_version = megatron_cpu.installed_version
    megatron_cpu.installed_version = lambda: "0.99.0"
    try:
        with pytest.raises(RuntimeError, match="0.99.0 is installed"):
            megatron_cpu.install()
    finally:
        megatron_cpu.installed_version = installed_version


def forward(model_dir: str, ids: torch.Tensor, tp: int, pp: int, out: str) -> None:
    """This rank's stage of the forward pass; the last stage's TP rank 0 saves the gathered logits to `out`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from services.trainer.megatron_model import build_gpt, init_model_parallel, to_megatron

    init_model_parallel(tp, pp, seed=0)
    stage, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    first, last = stage == 0, stage == pp - 1
    config = AutoConfig.from_pretrained(model_dir)
    model = build_gpt(config, tp, pp, pre_process=first, post_process=last)
    shard = to_megatron(load_file(os.path.join(model_dir, "model.safetensors")), config, tp, tp_rank, pp, stage)
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        if not first:  # the previous stage's hidden states, [seq, batch, hidden]
            hidden = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(input_ids=ids, position_ids=positions, attention_mask=None)
        if not last:
            dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        else:
            logits = gather_from_tensor_model_parallel_region(output)
            if tp_rank == 0:
                save_file({"logits": logits.contiguous()}, out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def run_case(case: dict, rank: int, master: str, pool: pathlib.Path) -> None:
    """`shim`: its checks, the outcome ('shim ok' or the failure) in pool/shim.txt. Else the logits of
    pool/models/<arch> on pool/ids-<arch>.pt into pool/<name>.safetensors, in a fresh process group."""
    if case["name"] == "shim":
        try:
            check_shim()
            outcome = "shim ok"
        except Exception:  # the test shows it; the other cases still run
            outcome = traceback.format_exc()
        (pool / "shim.txt").write_text(outcome)
        return
    from services.trainer.megatron_cpu import install

    install()
    dp = DataParallel(rank, case["size"], master, timeout_s=WAIT_S) if case["size"] > 1 else DataParallel()
    dp.ensure_group()
    ids = torch.load(pool / f"ids-{case['arch']}.pt")
    forward(str(pool / "models" / case["arch"]), ids, case["tp"], case["pp"], str(pool / f"{case['name']}.safetensors"))
    dp.close()
    if dist.is_initialized():  # a one-rank case's private group
        dist.destroy_process_group()


def warm(case: dict) -> None:
    """A rank that waits for another imports megatron-core meanwhile (no shim yet: `shim` installs it first)."""
    if case["name"] != "shim":
        import megatron.core.models.gpt  # noqa: F401


if __name__ == "__main__":
    serve(run_case, warm)
