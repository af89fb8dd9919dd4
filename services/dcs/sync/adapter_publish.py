"""A LoRA run's publish to SGLang engines: through SGLang's own LoRA adapter routes
(services/sglang_protocol/lora_adapters.py) instead of a broadcast.

    1. files   the adapter in peft's files (adapter_model.safetensors, adapter_config.json) in
               <adapter dir>/<run>-v<version>/, written under a temporary name and renamed into place, so an
               engine never reads half an adapter. The engines read them there, so the directory must be one
               every engine host sees at the same path: any directory when they run on the trainer's host, a
               shared filesystem otherwise.
    2. load    every engine: /load_lora_adapter {lora_name: <run>-v<version>, lora_path: that directory}
    3. switch  every engine: /update_weight_version <version>. The rollout watches the engines' versions; from
               then on its requests to that engine name this adapter (services/rollout/engine_pool.py).
    4. unload  every engine: the run's adapters older than the one before this version (/unload_lora_adapter),
               and their directories go. The previous adapter stays loaded until the next publish, for requests
               the rollout sent before it saw the switch (SGLang would load an unloaded adapter again from its
               directory for such a request).

Engines are not paused: loading an adapter leaves the running requests alone, and each request runs under the
adapter it named. A load the engine refuses (HTTP 400: no such directory there, a rank above its
--max-lora-rank, target modules outside its --lora-target-modules) is final: AdapterRefused. A load of a name the
engine holds already (a resend) counts as loaded."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import torch

from services.dcs.sync.engine_calls import SyncEngines
from services.sglang_protocol.client import SGLangClient, SGLangError
from services.sglang_protocol.lora_adapters import adapter_name, adapter_version

log = logging.getLogger(__name__)
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names


class AdapterRefused(ValueError):
    """An engine would not load the adapter: sending the same files again cannot help."""


class AdapterFiles:
    """A run's adapters as files in `directory`, and their loading by the run's SGLang engines."""

    def __init__(self, run_id: str, directory: str, config: dict, timeout_s: float):
        self.run_id = run_id
        self.directory = os.path.abspath(directory)
        self.config = config  # peft's adapter_config.json, as a dict
        self.timeout_s = timeout_s

    def write(self, version: int, tensors: dict[str, torch.Tensor]) -> str:
        """The adapter of `version` in peft's files: the directory's path."""
        from safetensors.torch import save_file

        final = os.path.join(self.directory, adapter_name(self.run_id, version))
        staging = f"{final}.tmp-{uuid.uuid4().hex}"
        os.makedirs(staging)
        try:
            save_file(
                {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, os.path.join(staging, ADAPTER_FILE)
            )
            with open(os.path.join(staging, ADAPTER_CONFIG), "w") as f:
                json.dump(self.config, f, indent=2)
            if os.path.isdir(final):  # written before by a publish of this number that failed before any load
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def load(self, engines: SyncEngines, version: int, path: str) -> None:
        """Steps 2-4 of the module docstring on every engine of the group."""
        name = adapter_name(self.run_id, version)
        loaded: dict[str, dict[str, str]] = {}
        engines.each(lambda m, e: loaded.__setitem__(e.base_url, self._load(e, name, path)))
        engines.each(lambda m, e: e.set_weight_version(str(version)))
        engines.each(lambda m, e: self._unload_stale(e, loaded[e.base_url], version))
        self._remove_stale(version)

    def _load(self, engine: SGLangClient, name: str, path: str) -> dict[str, str]:
        try:
            return engine.load_lora_adapter(name, path, timeout=self.timeout_s)
        except SGLangError as exc:
            if "already loaded" in exc.message:  # a resend: the name carries the version, so the same adapter
                return {}
            if exc.status == 400:
                raise AdapterRefused(
                    f"the SGLang server at {engine.base_url} did not load LoRA adapter {name} from {path}: "
                    f"{exc.message} (it reads the files at that path itself: the trainer's --adapter-dir must be a "
                    "directory every engine host sees at the same path; the server must be launched with "
                    "--enable-lora, --max-lora-rank >= the run's rank and --lora-target-modules covering its "
                    "target_modules)"
                ) from exc
            raise

    def kept(self, names, version: int) -> set[int]:
        """The run's adapter versions to keep among `names`: `version` and the newest one before it."""
        versions = {v for v in (adapter_version(self.run_id, n) for n in names) if v is not None}
        older = [v for v in versions if v < version]
        return {version, *([max(older)] if older else [])}

    def _unload_stale(self, engine: SGLangClient, loaded: dict[str, str], version: int) -> None:
        """Unload the run's adapters on `engine` that are not kept (an unload that fails is tried again at the
        next publish, which sees the adapter still loaded)."""
        keep = self.kept(loaded, version)
        for name in loaded:
            number = adapter_version(self.run_id, name)
            if number is None or number in keep:
                continue
            try:
                engine.unload_lora_adapter(name, timeout=self.timeout_s)
            except SGLangError as exc:
                log.warning(
                    "an engine did not unload an old adapter",
                    extra={"engine": engine.base_url, "adapter": name, "error": str(exc)},
                )

    def _remove_stale(self, version: int) -> None:
        """The directories of the run's adapters that are not kept, and staging directories left by a failure."""
        entries = os.listdir(self.directory)
        keep = self.kept(entries, version)
        for entry in entries:
            base, staging, _ = entry.partition(".tmp-")
            number = adapter_version(self.run_id, base)
            if number is not None and (staging or number not in keep):
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)
