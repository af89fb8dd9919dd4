"""SGLang's LoRA adapter routes as SGLangClient drives them (a part of that class, in its own module), and how
Sluice names a run's adapters on a server.

Read from the sglang 0.5.23 wheel: the routes in sglang/srt/entrypoints/http_server.py, their request and answer
types in sglang/srt/managers/io_struct.py, what they do in sglang/srt/managers/tokenizer_control_mixin.py,
tokenizer_manager.py and sglang/srt/lora/ (lora_manager.py, lora_registry.py, lora_config.py):

    POST /load_lora_adapter     {lora_name, lora_path, pinned}: the server reads the adapter in peft's files
                                (adapter_config.json, adapter_model.safetensors) from the directory lora_path
    POST /unload_lora_adapter   {lora_name}: done once the requests using it finished
        Both answer {success, error_message, loaded_adapters: name -> path}: 200 on success, else 400 (LoRA not
        enabled at launch, a name already loaded or not loaded, a rank above --max-lora-rank, target modules
        outside --lora-target-modules, no such directory).
    POST /generate              `lora_path` names the adapter the request's samples come from (one name, or one
                                per input): a name never loaded is a 400; one unloaded since is loaded again
                                from its path; none is the base model. The adapter is applied unmerged.
    POST /load_lora_adapter_from_tensors   the tensors pickled (torch's ForkingPickler, one payload per TP rank):
                                not driven, since Sluice sends no pickle between processes.

A server serves adapters only when launched with --enable-lora, --max-lora-rank and --lora-target-modules:
`enable_lora` in its server info. Sluice's built-in engine takes none of these routes: it merges a published
adapter into its weights (`lora_adapter_update` in its model info), so a generate request never names one there.

A run's adapter of weight version V is named `<run id>-v<V>` on every server (adapter_name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

if TYPE_CHECKING:
    from services.sglang_protocol.client import Generation


@dataclass(frozen=True)
class NamedAdapter:
    """The adapter a generate request names, and the weight version its samples are then generated under."""

    name: str
    version: int


def adapter_name(run_id: str, version: int) -> str:
    return f"{run_id}-v{version}"


def adapter_version(run_id: str, name: str) -> int | None:
    """The version of `run_id`'s adapter `name`; None for any other name (another run's, or not Sluice's)."""
    prefix = f"{run_id}-v"
    number = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(number) if number.isdigit() else None


def run_adapter(run_id: str, version: int) -> NamedAdapter:
    return NamedAdapter(adapter_name(run_id, version), version)


class _Client(Protocol):
    """What these calls use of SGLangClient (the class they are a part of)."""

    _model_info: dict | None
    _timeout_s: float

    def _server_args(self) -> dict: ...

    def takes_lora_adapter(self) -> bool: ...

    def _post(self, endpoint: str, body: dict | None = None, timeout: float | None = None) -> httpx.Response: ...

    def _check(self, endpoint: str, response: httpx.Response) -> dict: ...

    async def _arequest(
        self,
        method: str,
        endpoint: str,
        body: dict | None = None,
        params: dict | None = None,
        read_timeout_s: float | None = None,
    ) -> dict: ...


class LoRAAdapterRoutes:
    """SGLangClient's calls of SGLang's LoRA adapter routes (module docstring)."""

    _model_info: dict | None  # SGLangClient's: its server's model info, read once

    def serves_lora_adapters(self: _Client) -> bool:
        """Whether the server loads adapters by name (SGLang launched with --enable-lora), asked once."""
        return bool(self._server_args().get("enable_lora")) and not self.takes_lora_adapter()

    def lora_limits(self: _Client) -> tuple[int | None, list[str] | None]:
        """The server's --max-lora-rank and --lora-target-modules, where its server info says them."""
        args = self._server_args()
        modules = args.get("lora_target_modules")
        return args.get("max_lora_rank"), sorted(modules) if isinstance(modules, (list, tuple)) else None

    def load_lora_adapter(self: _Client, name: str, path: str, timeout: float | None = None) -> dict[str, str]:
        """Load the adapter in directory `path` (on the server's filesystem) as `name`: the adapters then
        loaded, name -> path. SGLangError (HTTP 400) with SGLang's reason when it does not."""
        data = self._check(
            "/load_lora_adapter",
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False}, timeout=timeout),
        )
        return dict(data.get("loaded_adapters") or {})

    def unload_lora_adapter(self: _Client, name: str, timeout: float | None = None) -> dict[str, str]:
        """Unload adapter `name` once the requests using it finished: the adapters left, name -> path."""
        data = self._check(
            "/unload_lora_adapter", self._post("/unload_lora_adapter", {"lora_name": name}, timeout=timeout)
        )
        return dict(data.get("loaded_adapters") or {})

    def set_weight_version(self: _Client, version: str) -> None:
        """Record `version` as the one the server serves (/update_weight_version, SGLang 0.5.6 on), its running
        requests untouched."""
        self._check(
            "/update_weight_version",
            self._post("/update_weight_version", {"new_version": version, "abort_all_requests": False}),
        )

    async def names_adapters(self: _Client) -> bool:
        """Whether a generate request names its adapter: not on a server that merges them into its weights (the
        built-in engine's model info says lora_adapter_update). Asked once, on the event loop."""
        if self._model_info is None:
            from services.sglang_protocol.client import EngineUnreachable, SGLangError  # client.py imports this

            info: dict = {}
            for endpoint in ("/model_info", "/get_model_info"):
                try:
                    info = await self._arequest("GET", endpoint, read_timeout_s=self._timeout_s)
                    break
                except EngineUnreachable:
                    raise  # asked again with the next request
                except SGLangError:
                    continue  # this release has no such route
            self._model_info = info
        return not (self._model_info or {}).get("lora_adapter_update", False)

    @staticmethod
    def from_adapter(generations: list[Generation], adapter: NamedAdapter) -> list[Generation]:
        """Generations of requests that named `adapter`: every token comes from its version (the server's own
        weight version may have moved on while they ran)."""
        for g in generations:
            g.spans = [(str(adapter.version), 0, len(g.output_ids))] if g.output_ids else []
        return generations
