"""Weights written from a stream a file at a time (services/model/weight_files.py): transformers loads the
directory, one file or several with an index, and a rank whose stream yields nothing writes nothing."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.weight_files import INDEX_FILE, SINGLE_FILE, write_weight_files


class ListStream:
    """A WeightStream over tensors in memory; `keep=False` is a rank that only takes part."""

    def __init__(self, named, keep: bool = True):
        self.named, self.keep, self.taken, self.closed = list(named), keep, 0, False

    def specs(self):
        return [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in self.named]

    def take(self, count):
        out = self.named[self.taken : self.taken + count]
        self.taken += len(out)
        return out if self.keep else []

    def close(self):
        self.closed = True


def _reloaded_equal(directory, model) -> None:
    model.config.save_pretrained(directory)
    again = AutoModelForCausalLM.from_pretrained(str(directory))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_several_files_with_an_index_load_as_the_model(tmp_path):
    model_dir = init_model(str(tmp_path / "m"), preset="tiny", arch="qwen2", seed=3)
    model = load_causal_lm(model_dir)[0]
    named = list(model.named_parameters())
    biggest = max(t.numel() * t.element_size() for _, t in named)
    stream = ListStream([(n, t.detach()) for n, t in named])
    out = tmp_path / "out"
    total = write_weight_files(stream, str(out), file_bytes=biggest)
    assert stream.closed and stream.taken == len(named)
    assert total == sum(t.numel() * t.element_size() for _, t in named)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == {n for n, _ in named} and index["metadata"]["total_size"] == total
    assert not (out / SINGLE_FILE).exists()
    _reloaded_equal(out, model)


def test_one_file_when_it_fits_and_nothing_from_a_rank_that_only_takes_part(tmp_path):
    model_dir = init_model(str(tmp_path / "m"), preset="tiny", arch="llama", seed=3)
    model = load_causal_lm(model_dir)[0]
    named = [(n, t.detach()) for n, t in model.named_parameters()]
    out = tmp_path / "out"
    write_weight_files(ListStream(named), str(out))
    assert sorted(os.listdir(out)) == [SINGLE_FILE]
    _reloaded_equal(out, model)
    follower = ListStream(named, keep=False)
    assert write_weight_files(follower, str(tmp_path / "none")) == 0
    assert follower.taken == len(named) and follower.closed and not (tmp_path / "none").exists()
