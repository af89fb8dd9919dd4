"""`sluice export CHECKPOINT OUT_DIR`: a trainer checkpoint as a plain Hugging Face model directory.

OUT_DIR gets config.json, model.safetensors, generation_config.json (if the checkpoint has one) and the
tokenizer files with the chat template; not the optimizer state or trainer_state.json. transformers'
AutoModelForCausalLM and AutoTokenizer load it, and so do `sluice engine --model` and SGLang.

CHECKPOINT is one checkpoint (`<checkpoint-dir>/actor/step_<N>`), or a trainer's --checkpoint-dir (or its
`actor/` folder), whose newest complete checkpoint is taken.

A LoRA run's checkpoint holds only the adapter, in peft's files (adapter_model.safetensors, adapter_config.json,
whose base_model_name_or_path is the run's model): it is merged into the base model (peft's merge_and_unload,
W = W0 + alpha / r * B @ A) and the export is the full merged model. --base names the base model directory when
it moved since the run."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from services.model.loading import ModelDirError, check_model_dir, load_causal_lm
from services.run_contract.checkpoint import copy_tokenizer, latest_checkpoint, read_checkpoint
from services.runtime.settings_cli import HelpWithDefaults

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a LoRA checkpoint (services/trainer/lora.py)


class ExportError(ValueError):
    """What `sluice export` was given cannot be exported; the message names the path and the problem."""


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory `path` names: itself, or the newest checkpoint under it (a --checkpoint-dir
    or its actor/ folder)."""
    if not os.path.isdir(path):
        raise ExportError(f"checkpoint {path!r} does not exist or is not a directory")
    if read_checkpoint(path) is not None:
        return path
    for directory, role in ((path, "actor"), (os.path.dirname(os.path.abspath(path)), os.path.basename(path))):
        found = latest_checkpoint(directory, role)
        if found is not None:
            return found.path
    if os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return path  # a model (or peft adapter) directory (no trainer_state.json): exported as it is
    raise ExportError(
        f"{path!r} is neither a checkpoint (no trainer_state.json) nor a directory holding "
        f"checkpoints (no complete actor/step_* under it)"
    )


def export_checkpoint(
    checkpoint: str, out_dir: str, dtype: str | None = None, force: bool = False, base: str | None = None
) -> str:
    """Write the model of `checkpoint` to `out_dir` as a Hugging Face directory, in `dtype` (None: as stored);
    a LoRA checkpoint's adapter merged into its base model (`base`, or the one its adapter_config.json names).
    Written to a temporary directory and renamed; an existing non-empty `out_dir` is an error unless `force`.
    Returns the checkpoint directory exported."""
    source = resolve_checkpoint(checkpoint)
    adapter = os.path.isfile(os.path.join(source, ADAPTER_CONFIG))
    base = _base_model(source, base) if adapter else None
    try:
        check_model_dir(base or source, tokenizer=not adapter)
    except ModelDirError as exc:
        raise ExportError(f"cannot export {source!r}: {exc.problem}") from None
    out_dir = os.path.abspath(out_dir)
    if os.path.commonpath([out_dir, os.path.abspath(source)]) == out_dir:  # --force would delete the source
        raise ExportError(f"{out_dir!r} holds the checkpoint {source!r} itself: export to another directory")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not force:
        raise ExportError(f"{out_dir!r} exists and is not empty (pass --force to replace it)")
    if base is not None:  # an adapter's: merged into its base
        from peft import PeftModel  # only for a LoRA checkpoint

        model = PeftModel.from_pretrained(load_causal_lm(base, dtype or _stored_dtype(base))[0], source)
        model = model.merge_and_unload()
    else:
        model, _ = load_causal_lm(source, dtype or _stored_dtype(source))
    tmp = out_dir.rstrip(os.sep) + ".export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)  # config.json, generation_config.json, *.safetensors
    has_tokenizer = os.path.isfile(os.path.join(source, "tokenizer_config.json"))
    copy_tokenizer(source if has_tokenizer or base is None else base, tmp)  # a bare adapter: the base's
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    elif os.path.exists(out_dir):
        os.remove(out_dir)
    os.replace(tmp, out_dir)
    return source


def _base_model(source: str, base: str | None) -> str:
    """The base model directory of the LoRA checkpoint `source`: `base`, or what its adapter_config.json names."""
    try:
        with open(os.path.join(source, ADAPTER_CONFIG)) as f:
            named = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise ExportError(f"{source!r}: its {ADAPTER_CONFIG} does not read: {exc}") from None
    found = base or named
    if not found or not os.path.isfile(os.path.join(found, "config.json")):
        raise ExportError(
            f"{source!r} is a LoRA adapter whose base model {found!r} is not a model directory here: "
            "pass --base with the run's model directory"
        )
    return found


def _stored_dtype(model_dir: str) -> str:
    """The dtype config.json says the weights are stored in (`dtype`, or `torch_dtype` in older files)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice export", description=__doc__, formatter_class=HelpWithDefaults)
    parser.add_argument("checkpoint", help="a checkpoint directory (<dir>/actor/step_<N>) or a --checkpoint-dir")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="parameter dtype of the export (None: the checkpoint's own)"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument(
        "--base",
        default=None,
        help=("a LoRA checkpoint's base model directory (None: the one its adapter_config.json names)"),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        source = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.force, args.base)
    except (ExportError, ModelDirError) as exc:
        print(f"sluice export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {source} -> {os.path.abspath(args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
