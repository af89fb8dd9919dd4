"""megatron-core on CPU: the shim is for the pinned version and each redirection is in place; HF -> megatron ->
HF is bit-exact for every tensor/pipeline split; a GPTModel built from the HF config and loaded with its shards
gives the HF model's logits with TP=1, TP=2 and PP=2 (real gloo processes)."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.runtime.processes import ChildProcess, free_port
from services.trainer.megatron_model import to_hf, to_megatron


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch=request.param, seed=3)


SHIM_CHECK = """
import importlib, pytest, torch
from services.trainer import megatron_cpu
assert megatron_cpu.installed_version() == megatron_cpu.MEGATRON_CORE_VERSION, (
    "megatron-core moved: check services/trainer/megatron_cpu.py against it, then move the pin")
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
megatron_cpu.installed_version = lambda: "0.99.0"
with pytest.raises(RuntimeError, match="0.99.0 is installed"):
    megatron_cpu.install()
print("shim ok")
"""


def test_the_shim_is_for_the_installed_megatron_and_redirects_every_named_call():
    """In a process of its own: the shim patches torch.cuda for the whole process."""
    done = subprocess.run([sys.executable, "-c", SHIM_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "shim ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_and_back_is_exact(model_dir, tp, pp):
    hf = load_file(f"{model_dir}/model.safetensors")
    config = AutoConfig.from_pretrained(model_dir)
    stages = [[to_megatron(hf, config, tp, r, pp, s) for r in range(tp)] for s in range(pp)]
    back = to_hf(stages, config)
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    if tp == 2:  # the shards really are halves
        assert stages[0][0]["embedding.word_embeddings.weight"].shape[0] == config.vocab_size // 2


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_megatron_model_gives_the_hf_logits(model_dir, tmp_path, tp, pp):
    model = load_causal_lm(model_dir)[0]
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    out, master = tmp_path / "logits.safetensors", f"127.0.0.1:{free_port()}"
    procs = [ChildProcess(f"mg-{r}", [sys.executable, "-m", "tests.trainer.megatron_worker", "--model", model_dir,
                                      "--master", master, "--out", str(out), "--rank", str(r), "--tp", str(tp),
                                      "--pp", str(pp)], str(tmp_path / f"mg-{r}.log")) for r in range(tp * pp)]
    assert [p.proc.wait(180) for p in procs] == [0] * (tp * pp), [p.log_tail() for p in procs]
    torch.testing.assert_close(load_file(str(out))["logits"], want, atol=1e-5, rtol=1e-5)
