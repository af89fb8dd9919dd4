"""What the SGLang 0.5.23 stand-in (tests/dcs/sglang_receiver.py) serves when it is given a model directory:
/generate over that model (transformers), and SGLang's LoRA adapter routes, answered as the sglang 0.5.23 wheel
answers them. Read from the wheel:
  sglang/srt/entrypoints/http_server.py          the routes: /load_lora_adapter, /unload_lora_adapter (200 when
                                                 the result's `success`, else 400, the result as the body);
                                                 /generate's error answer (400 {"error": {"message": ...}})
  sglang/srt/managers/io_struct.py               LoadLoRAAdapterReqInput {lora_name, lora_path, pinned},
                                                 UnloadLoRAAdapterReqInput {lora_name}, LoRAUpdateOutput
                                                 {success, error_message, loaded_adapters: name -> path}
  sglang/srt/managers/tokenizer_control_mixin.py load/unload: "LoRA is not enabled" without --enable-lora
  sglang/srt/managers/tokenizer_manager.py       a generate request's `lora_path` (one name, or one per input):
                                                 refused without --enable-lora; a name never loaded is an error;
                                                 a name loaded once and unloaded since is loaded again from its
                                                 path (`lora_ref_cache`)
  sglang/srt/lora/lora_manager.py, mem_pool.py   a new adapter is checked: its name not loaded yet, rank <=
                                                 --max-lora-rank, its target modules within --lora-target-modules
  sglang/srt/lora/lora_config.py, lora.py        adapter_config.json and the adapter's safetensors from the
                                                 directory; the update is scaled by lora_alpha / r
  sglang/srt/lora/lora_registry.py               "LoRA with name X does not exist" for an unknown unload
SGLang applies an adapter unmerged, per request; this stand-in merges W0 + (alpha / r) B @ A into a copy of the
model per loaded adapter, the same function of the weights. Sampling: temperature (0 = greedy) and
`sampling_seed`; top_p and top_k are not applied. A full weight update (/update_weights_from_distributed) does not
reach the generating model: the stand-in's own weights (sglang_receiver.py) are a separate set.

Not SGLang: /stats gains `lora` (every load, unload and implicit reload, in order) and `generated` (the
`lora_path` of every generate request's inputs, None for the base model)."""

from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

# SGLang 0.5.23's normalization of adapter target modules (sglang/srt/lora/utils.py): stacked projections
STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoadBody(BaseModel):  # LoadLoRAAdapterReqInput (a missing field: FastAPI's 422, as SGLang answers)
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadBody(BaseModel):  # UnloadLoRAAdapterReqInput
    lora_name: str


@dataclass
class LoraArgs:
    """The LoRA server arguments the stand-in honours (SGLang's --enable-lora, --max-lora-rank,
    --lora-target-modules, --max-loras-per-batch)."""

    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loras_per_batch: int = 8


def normalized(modules) -> set[str]:
    return {STACKED.get(m, m) for m in modules}


def merged(base: torch.nn.Module, path: str, config: dict) -> torch.nn.Module:
    """A copy of `base` with the adapter in `path` merged: W = W0 + (lora_alpha / r) * B @ A per target layer."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    scale = config["lora_alpha"] / config["r"]
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        with torch.no_grad():
            params[module + ".weight"] += scale * (b.float() @ a.float())
    return model


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], params: dict, eos: set[int]) -> dict:
    """One sample: its output ids, their log-probs and the finish reason, as SGLang's meta info has them."""
    temperature = float(params.get("temperature", 1.0))
    seed = params.get("sampling_seed")
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    stop = (set() if params.get("ignore_eos") else set(eos)) | set(params.get("stop_token_ids") or [])
    ids: list[int] = []
    logprobs: list[float] = []
    inputs, past = torch.tensor([prompt]), None
    reason: dict = {"type": "length", "length": 0}
    for _ in range(int(params.get("max_new_tokens", 128))):
        out = model(input_ids=inputs, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
        if temperature <= 0:
            lps = torch.log_softmax(logits, -1)
            token = int(lps.argmax())
        else:
            lps = torch.log_softmax(logits / temperature, -1)
            token = int(torch.multinomial(lps.exp(), 1, generator=generator))
        ids.append(token)
        logprobs.append(float(lps[token]))
        if token in stop:
            reason = {"type": "stop", "matched": token}
            break
        inputs = torch.tensor([[token]])
    if reason["type"] == "length":
        reason["length"] = len(ids)
    return {"output_ids": ids, "logprobs": logprobs, "finish_reason": reason}


class LoraServing:
    """The model and its loaded adapters, with SGLang's answers."""

    def __init__(self, model_path: str, lora: LoraArgs):
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        eos = self.base.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.lora = lora
        self.loaded: OrderedDict[str, str] = OrderedDict()  # name -> path (SGLang's LoRARegistry)
        self.ever_loaded: dict[str, str] = {}  # name -> path, never forgotten (the tokenizer's lora_ref_cache)
        self.models: dict[str, torch.nn.Module] = {}
        self.events: list[list[str]] = []
        self.generated: list[str | None] = []
        self.lock = threading.RLock()  # routes run on FastAPI's threads

    @staticmethod
    def result(success: bool, error: str | None = None, loaded: dict | None = None) -> JSONResponse:
        body = {
            "rid": None,
            "http_worker_ipc": None,
            "success": success,
            "error_message": error,
            "loaded_adapters": loaded,
        }
        return JSONResponse(body, status_code=200 if success else 400)

    def load(self, name: str, path: str) -> JSONResponse:
        with self.lock:
            return self._load(name, path)

    def _load(self, name: str, path: str) -> JSONResponse:
        if not self.lora.enable_lora:
            return self.result(False, NOT_ENABLED)
        try:  # what the backend checks and loads; its errors come back with the adapters it holds
            if not os.path.isdir(path):  # SGLang then asks the Hugging Face hub for a repo of that id
                raise ValueError(
                    f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                    "Use `repo_type` argument if needed."
                )
            with open(os.path.join(path, "adapter_config.json")) as f:
                config = json.load(f)
            if name in self.loaded:
                raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            targets = self.lora.lora_target_modules or []
            if config["r"] > (self.lora.max_lora_rank or 0) or not (
                "all" in targets or normalized(config["target_modules"]) <= normalized(targets)
            ):
                raise ValueError(
                    f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                )
            self.models[name] = merged(self.base, path, config)
        except (OSError, ValueError, KeyError) as exc:
            return self.result(False, str(exc), dict(self.loaded))
        self.loaded[name] = self.ever_loaded[name] = path
        self.events.append(["load", name])
        return self.result(True, "", dict(self.loaded))

    def unload(self, name: str) -> JSONResponse:
        if not self.lora.enable_lora:
            return self.result(False, NOT_ENABLED)
        with self.lock:
            return self._unload(name)

    def _unload(self, name: str) -> JSONResponse:
        if name not in self.loaded:
            return self.result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {self.loaded.keys()}")
        del self.loaded[name]
        self.models.pop(name, None)
        self.events.append(["unload", name])
        return self.result(True, "", dict(self.loaded))

    def resolve(self, names: list[str | None]) -> None:
        """A generate request's adapters, as the tokenizer manager resolves them (ValueError: its 400)."""
        wanted = [n for n in names if n]
        if wanted and not self.lora.enable_lora:
            raise ValueError(
                f"LoRA adapter '{wanted[0]}' was requested, but LoRA is not enabled. Please launch the "
                "server with --enable-lora flag and preload adapters using --lora-paths or "
                "/load_lora_adapter endpoint."
            )
        for name in dict.fromkeys(wanted):
            if name in self.loaded:
                continue
            if name not in self.ever_loaded:
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self.ever_loaded.keys()}."
                )
            answer = self._load(name, self.ever_loaded[name])  # SGLang loads it again from its path
            if answer.status_code != 200:
                raise ValueError(
                    f"Failed to implicitly load LoRA adapter {name}: {json.loads(answer.body)['error_message']}"
                )
            self.events[-1][0] = "reload"

    def generate(self, body: dict, weight_version: str):
        inputs = body.get("input_ids")
        single = bool(inputs) and isinstance(inputs[0], int)
        inputs = [inputs] if single else inputs
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(inputs)
        names = body.get("lora_path")
        names = names if isinstance(names, list) else [names] * len(inputs)
        with self.lock:  # a request holds the adapters it resolved, as SGLang's does until it finishes
            try:
                self.resolve(names)
            except ValueError as exc:
                return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
            self.generated.extend(names)
            models = [self.models[name] if name else self.base for name in names]
        out = []
        for prompt, p, model in zip(inputs, params, models):
            s = sample(model, prompt, p, self.eos)
            meta = {
                "finish_reason": s["finish_reason"],
                "prompt_tokens": len(prompt),
                "completion_tokens": len(s["output_ids"]),
                "weight_version": weight_version,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s["logprobs"], s["output_ids"])]
            out.append({"output_ids": s["output_ids"], "meta_info": meta})
        return out[0] if single else out


def add_generation(app: FastAPI, state: dict, model_path: str, lora: LoraArgs) -> LoraServing:
    """/generate and the LoRA adapter routes over the model in `model_path`; state["version"] is the served
    weight version."""
    serving = LoraServing(model_path, lora)

    @app.post("/generate")
    def generate(body: dict):
        return serving.generate(body, state["version"])

    @app.post("/load_lora_adapter")
    def load(body: LoadBody):
        return serving.load(body.lora_name, body.lora_path)

    @app.post("/unload_lora_adapter")
    def unload(body: UnloadBody):
        return serving.unload(body.lora_name)

    @app.get("/v1/models")
    async def models():
        # the base model, then every loaded adapter (id: its name, root: its path), as SGLang 0.5.23 lists them
        cards = [{"id": model_path, "object": "model", "root": model_path, "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": model_path} for n, p in serving.loaded.items()]
        return {"object": "list", "data": cards}

    return serving
