"""megatron-core on CPU: the shim is for the pinned version and each redirection is in place; HF -> megatron ->
HF is bit-exact for every tensor/pipeline split; a GPTModel built from the HF config and loaded with its shards
gives the HF model's logits with TP=1, TP=2 and PP=2 (real gloo processes)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.trainer.megatron_model import to_hf, to_megatron
from tests.trainer.rank_pool import TEST_S, made_once, run_pool

pytestmark = [
    pytest.mark.timeout(TEST_S),
    pytest.mark.one_worker,
]  # the pool's set-up, or the wait for another worker's


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch=request.param, seed=3)


# the two-rank layouts first: the pool's second rank is then done
LOGITS = [(arch, tp, pp) for tp, pp in ((2, 1), (1, 2), (1, 1)) for arch in ("qwen2", "llama")]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Made once per test run by one pool of two real gloo ranks (tests/trainer/megatron_worker.py): the shim's
    checks (shim.txt), and each model's logits per layout (<arch>-<tp>-<pp>.safetensors) on the token ids
    ids-<arch>.pt; the models under models/<arch>."""

    def make(directory):
        for arch in ("qwen2", "llama"):
            model_dir = init_model(str(directory / "models" / arch), preset="tiny", arch=arch, seed=3)
            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
            ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
            torch.save(ids, directory / f"ids-{arch}.pt")
        plan = [{"name": "shim", "size": 1}] + [
            {"name": f"{arch}-{tp}-{pp}", "size": tp * pp, "arch": arch, "tp": tp, "pp": pp} for arch, tp, pp in LOGITS
        ]
        run_pool("tests.trainer.megatron_worker", plan, directory)

    return made_once(tmp_path_factory, "megatron-cpu", make)


def test_the_shim_is_for_the_installed_megatron_and_redirects_every_named_call(pool):
    """In a pool rank before it builds anything: the shim patches torch.cuda for the whole process."""
    assert (pool / "shim.txt").read_text() == "shim ok"


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


@pytest.mark.parametrize("arch,tp,pp", sorted(LOGITS), ids=[f"{a}-{t}-{p}" for a, t, p in sorted(LOGITS)])
def test_megatron_model_gives_the_hf_logits(pool, arch, tp, pp):
    model = load_causal_lm(str(pool / "models" / arch))[0]
    ids = torch.load(pool / f"ids-{arch}.pt")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    got = load_file(str(pool / f"{arch}-{tp}-{pp}.safetensors"))["logits"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
