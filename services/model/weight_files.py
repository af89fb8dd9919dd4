"""A model's weights written as Hugging Face safetensors files from a stream of full tensors, a file at a time:
`model.safetensors`, or `model-0000K-of-0000N.safetensors` files with a `model.safetensors.index.json` when
the weights are larger than one file's budget (transformers, SGLang and `sluice engine` load either).

The stream is a sharded trainer's (services/dcs/sync/layout.py's WeightStream: FSDP2 gathers each parameter,
megatron sends each unit to rank 0): every rank calls `write_weight_files` with its own stream, in the same
order, so each gather is a collective all ranks join; only the rank whose stream yields tensors writes, and
it holds at most one file's tensors at a time, never the whole model."""

from __future__ import annotations

import json
import os

from safetensors.torch import load_file, save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FILE_BYTES = 2 << 30  # one file's budget (a tensor larger than it gets a file of its own)


def plan_files(specs, file_bytes: int) -> list[list[str]]:
    """The names in each file, in stream order: a new file when the next tensor would overflow the budget."""
    files: list[list[str]] = []
    used = 0
    for name, tensor in specs:
        nbytes = tensor.numel() * tensor.element_size()
        if not files or (used + nbytes > file_bytes and used > 0):
            files.append([])
            used = 0
        files[-1].append(name)
        used += nbytes
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_weight_files(stream, directory: str, file_bytes: int = FILE_BYTES) -> int:
    """Take `stream` to its end, writing what it yields into `directory` (created), a file at a time; returns
    the bytes written (0 on a rank whose stream yields nothing). The stream is closed whatever happens."""
    try:
        specs = stream.specs()
        files = plan_files(specs, file_bytes)
        names = file_names(len(files))
        weight_map, total = {}, 0
        for members, file_name in zip(files, names):
            tensors = stream.take(len(members))
            if not tensors:
                continue  # a rank that only takes part in the gathers
            os.makedirs(directory, exist_ok=True)
            save_file(
                {n: t.contiguous() for n, t in tensors}, os.path.join(directory, file_name), metadata={"format": "pt"}
            )
            for n, t in tensors:
                weight_map[n] = file_name
                total += t.numel() * t.element_size()
        if weight_map and len(files) > 1:
            with open(os.path.join(directory, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        return total
    finally:
        stream.close()


def read_weight_files(directory: str) -> dict:
    """Every tensor of a model directory's safetensors files (one file, or the files its index names), on the
    CPU. Only safetensors: a pickled `pytorch_model.bin` is refused (ValueError), never loaded."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory")
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{directory} holds no .safetensors weights (pickled .bin files are not read)")
    tensors: dict = {}
    for name in names:
        if os.path.basename(name) != name:
            raise ValueError(f"{index} names {name!r}, which is not a file of the directory")
        tensors.update(load_file(os.path.join(directory, name)))
    return tensors
