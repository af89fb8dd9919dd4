"""The command line `sluice run` gives a real SGLang server (`stack.engine: sglang`), as SGLang 0.5.23's
`python -m sglang.launch_server` parses it (sglang/srt/server_args.py `prepare_server_args`; every ServerArgs
field is the flag `--field-name`, a bool field a `store_true` flag with no `--no-` form).

The stack sets the model, host, port and GPU of each server itself, and gives the api key (the stack's token)
in a `--config` YAML file, never in argv (services/launch/sglang_engine.py); every other flag comes from the
run file's `stack.engine_flags` as it is. SGLang checks those when it starts: an unknown one stops the server
with argparse's "unrecognized arguments", which `sluice run` reports with the server's log."""

from __future__ import annotations

import importlib.util
import re
import sys
from typing import Union

from services.run_contract.run_config import RunConfig

Scalar = Union[bool, int, float, str]
SGLANG_RELEASE = "0.5.23"  # the release whose server_args.py these flags were read from
INSTALL = f'pip install "sglang[all]=={SGLANG_RELEASE}"'
# flags the stack sets on every server (a run file may not): where it listens, what it loads, its key
SET_BY_STACK = ("model_path", "model", "host", "port", "api_key", "admin_api_key", "config")
_NAME = re.compile(r"[a-z][a-z0-9_]*")
# what --lora-target-modules takes (sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES, and "all")
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)


def check_sglang_flags(flags: dict[str, Scalar]) -> None:
    """A run file's engine_flags for SGLang: ServerArgs field names, none of those the stack sets."""
    for name in flags:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not an SGLang server flag name (a ServerArgs field, e.g. mem_fraction_static)"
            )
        if name in SET_BY_STACK:
            raise ValueError(
                f"{name!r} is set by `sluice run` on every SGLang server; the stack sets {', '.join(SET_BY_STACK)}"
            )


def render(flags: dict[str, Scalar]) -> list[str]:
    """engine_flags as SGLang's argv: true bools as bare flags, false ones left out (SGLang's default)."""
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def server_argv(
    model: str, port: int, flags: tuple[str, ...] | list[str], index: int, config_path: str | None
) -> list[str]:
    """`python -m sglang.launch_server` for the index-th server: this Python (where SGLang was found), the
    run's model, 127.0.0.1:port, the flags, its GPUs, and the key file when there is a token."""
    config = ["--config", config_path] if config_path else []
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *gpu_argv(list(flags), index),
        *config,
    ]


def gpu_argv(flags: list[str], index: int) -> list[str]:
    """The flags with the index-th server's `--base-gpu-id`: servers side by side, each on its own
    tp_size GPUs from the run file's base_gpu_id (0 by default): server i starts at base + i * tp_size."""
    base, tp, rest, i = 0, 1, [], 0
    while i < len(flags):
        if flags[i] == "--base-gpu-id" and i + 1 < len(flags):
            base, i = int(flags[i + 1]), i + 2
            continue
        if flags[i] in ("--tp-size", "--tensor-parallel-size") and i + 1 < len(flags):
            tp = int(flags[i + 1])
        rest.append(flags[i])
        i += 1
    return [*rest, "--base-gpu-id", str(base + index * tp)]


def sglang_missing() -> str | None:
    """Why SGLang servers cannot start from this Python (None: `sglang` is importable here)."""
    if importlib.util.find_spec("sglang") is not None:
        return None
    return (
        f"SGLang is not installed in this Python ({sys.executable}), so no SGLang server can start: "
        f"install it ({INSTALL}; it needs NVIDIA GPUs), or set stack.engine: builtin"
    )


def token_problem(token: str) -> str | None:
    """A token SGLang cannot take as its api key (None: it can). SGLang's argparse reads a value that starts
    with '-' as another flag, so such a key would stop every server at start."""
    if token.startswith("-"):
        return (
            "the stack's auth token starts with '-', which SGLang's argument parser takes for a flag, "
            "so an SGLang server cannot use it as its api key: choose a token that does not start with '-'"
        )
    return None


def lora_argv(flags: tuple[str, ...], rank: int, target_modules: list[str]) -> tuple[str, ...]:
    """A LoRA run's server flags: `flags` and, where they do not set them, --enable-lora, --max-lora-rank (the run's
    rank) and --lora-target-modules (its target modules), which SGLang needs to load adapters by name while it
    runs (sglang/srt/arg_groups/lora_hook.py; services/dcs/sync/adapter_publish.py)."""
    extra: list[str] = []
    if "--enable-lora" not in flags:
        extra.append("--enable-lora")
    if "--max-lora-rank" not in flags:
        extra += ["--max-lora-rank", str(rank)]
    if "--lora-target-modules" not in flags:
        extra += ["--lora-target-modules", *target_modules]
    return (*flags, *extra)


def lora_problem(target_modules: list[str]) -> str | None:
    """Why SGLang cannot serve a LoRA run's adapter (None: it can): target modules it applies no adapter to."""
    unknown = [m for m in target_modules if m not in LORA_TARGET_MODULES]
    if not unknown:
        return None
    return (
        f"trainer.lora.target_modules {unknown} are not modules SGLang {SGLANG_RELEASE} applies LoRA adapters to "
        f"(its --lora-target-modules takes {', '.join(LORA_TARGET_MODULES)}): target those, or use built-in "
        "engines"
    )


def engine_flags(run: RunConfig, engine: str, engine_args: tuple[str, ...], token: str) -> tuple[str, ...]:
    """The run's engine flags; for SGLang servers, refused (RuntimeError) before anything starts when SGLang
    cannot serve the run, and a LoRA run's adapter flags added (LocalRun's `engine`)."""
    if engine != "sglang":
        return engine_args
    lora = run.trainer.lora
    refusal = (lora_problem(lora.target_modules) if lora else None) or sglang_missing() or token_problem(token)
    if refusal:
        raise RuntimeError(f"engine sglang: {refusal}")
    if lora is not None:  # the adapter is loaded by name (adapter_publish.py)
        engine_args = lora_argv(engine_args, lora.rank, lora.target_modules)
    return engine_args
