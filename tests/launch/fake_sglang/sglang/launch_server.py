"""`python -m sglang.launch_server` as SGLang 0.5.23 parses its command line, serving the SGLang stand-in
(tests/dcs/sglang_receiver.py, release 0.5.23) instead of a model.

What it keeps of SGLang 0.5.23 (read from the wheel: sglang/srt/server_args.py `prepare_server_args`,
sglang/srt/utils/server_args_config_parser.py, sglang/srt/arg_groups/fields/*.py, sglang/srt/utils/auth.py,
sglang/srt/entrypoints/http_server.py and engine.py):
- the flags `sluice run` passes, with SGLang's names, aliases, types and choices (a bool field is a store_true
  flag); any other flag fails as argparse fails: exit 2, "unrecognized arguments";
- `--config FILE`: one YAML mapping (`.yaml`/`.yml`, else an error), its keys made flags and put before the
  command line's (which win), a true bool as the bare flag, a false one left out;
- the server arguments, api key included, logged at start (engine.py logs `server_args=` unredacted);
- the api key: every route needs `Authorization: Bearer <key>` except OPTIONS and paths starting /health,
  /ready or /metrics (401 `{"error": "Unauthorized"}`);
- `/health_generate`, the same handler as `/health`;
- the LoRA flags (`--enable-lora`, `--max-lora-rank`, `--lora-target-modules`, `--max-loras-per-batch`,
  `--max-loaded-loras`) and their start check (sglang/srt/arg_groups/lora_hook.py); with a model directory as
  `--model-path`, /generate and the LoRA adapter routes (tests/dcs/sglang_generation.py).
Not SGLang: GET /fake_launch (behind the key) answers what this process was given, for the tests."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

import uvicorn
import yaml
from fastapi.responses import JSONResponse

from tests.dcs.sglang_generation import LoraArgs
from tests.dcs.sglang_receiver import build

LORA_TARGET_MODULES = [
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
    "all",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang serve")
    p.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--dtype", type=str, default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"]
    )
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true", default=False)
    p.add_argument("--api-key", type=str, default=None)
    p.add_argument("--admin-api-key", type=str, default=None)
    p.add_argument("--config", type=str)
    # the LoRA flags (sglang/srt/arg_groups/fields/lora.py; the target modules' choices from
    # sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES plus "all")
    p.add_argument("--enable-lora", action="store_true", default=None)
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", type=str, nargs="*", default=None, choices=LORA_TARGET_MODULES)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    return p


def merge_config(p: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], dict]:
    """SGLang 0.5.23's ConfigArgumentMerger: the file's keys as flags, before the command line's."""
    indices = [i for i, a in enumerate(argv) if a == "--config"]
    if len(indices) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    if indices[0] == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = argv[indices[0] + 1]
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {os.path.splitext(path)[1]}")
    if not os.path.exists(path):
        raise ValueError(f"Config file not found: {path}")
    seen = {
        "path": path,
        "mode": oct(os.stat(path).st_mode & 0o777),
        "dir_mode": oct(os.stat(os.path.dirname(path)).st_mode & 0o777),
    }
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    store_true = {a.dest for a in p._actions if isinstance(a, argparse._StoreTrueAction)}
    args: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            args += (
                ([f"--{key}"] if value else [])
                if key.replace("-", "_") in store_true
                else [f"--{key}", str(value).lower()]
            )
        elif isinstance(value, dict):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args + argv[: indices[0]] + argv[indices[0] + 2 :], seen


def add_api_key_check(app, api_key: str | None) -> None:
    """SGLang 0.5.23's api-key middleware for routes of the normal auth level."""

    @app.middleware("http")
    async def check(request, call_next):
        path = request.url.path
        if request.method == "OPTIONS" or not api_key or path.startswith(("/health", "/ready", "/metrics")):
            return await call_next(request)
        parts = (request.headers.get("Authorization") or "").split(" ", 1)
        if len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], api_key):
            return await call_next(request)
        return JSONResponse({"error": "Unauthorized"}, status_code=401)


def main(argv: list[str]) -> None:
    p = parser()
    merged, config = merge_config(p, argv) if "--config" in argv else (argv, None)
    args = p.parse_args(merged)
    print(f"server_args={vars(args)}", flush=True)
    if args.enable_lora:  # sglang/srt/arg_groups/lora_hook.py check_lora_server_args, with no --lora-paths
        assert args.max_lora_rank and args.lora_target_modules, (
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules for LoRA initialization."
        )
    lora = LoraArgs(bool(args.enable_lora), args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch)
    app = build("0.5.23", None, args.model_path, lora)
    health = next(route.endpoint for route in app.routes if getattr(route, "path", None) == "/health")
    app.add_api_route("/health_generate", health, methods=["GET"])

    @app.get("/fake_launch")
    async def fake_launch():
        return {"argv": argv, "args": vars(args), "config": config}

    add_api_key_check(app, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
