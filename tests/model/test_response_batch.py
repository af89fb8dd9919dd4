import pytest
import torch

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_log_probs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    model, _ = load_causal_lm(init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="llama", seed=3))
    return model


def test_padded_batch_log_probs_equal_each_sample_alone(model):
    samples = [([5, 9, 13], [40, 41]), ([7], [8, 9, 10, 11, 12]), ([1, 2, 3, 4, 5, 6], [99])]
    tokens = [torch.tensor(p + r) for p, r in samples]
    batch = ResponseBatch.build(tokens, [len(p) for p, _ in samples], [len(r) for _, r in samples])
    got = response_log_probs(model, batch)
    assert got.shape == (3, 5)
    for i, (p, r) in enumerate(samples):
        logits = model(input_ids=torch.tensor([p + r])).logits[0].log_softmax(-1)
        want = torch.stack([logits[len(p) - 1 + j, tok] for j, tok in enumerate(r)])
        torch.testing.assert_close(got[i, : len(r)], want, atol=1e-5, rtol=0)
        assert torch.all(got[i, len(r) :] == 0) and batch.mask[i].sum() == len(r)
    assert [len(x) for x in batch.to_ragged(got)] == [2, 5, 1]


def test_inconsistent_lengths_are_rejected():
    with pytest.raises(ValueError, match="sample 0"):
        ResponseBatch.build([torch.tensor([1, 2, 3])], [1], [5])
