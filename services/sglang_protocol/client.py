"""SGLangClient: the only code that knows the SGLang HTTP protocol (the subset in docs/engine.md).

One class drives a real SGLang server and Sluice's built-in engine alike. It copes with the release
differences that matter here:
  * 0.5.5  /pause_generation takes no body (and always aborts); versions from /get_weight_version
  * 0.5.6+ /pause_generation {"mode": ...}; /weight_version; /update_weights_from_distributed takes
           load_format "flattened_bucket" (one broadcast per call; 0.5.5 ignores the field), told apart by the
           `version` of /server_info (/get_server_info)
  * 0.5.23 weight updates sit between /begin_weight_update and /end_weight_update; the version is
           read from /model_info
Differences are discovered by asking (404 / 4xx on the newer form), once, and remembered.

Two groups of routes are written in modules of their own beside this one, as parts of the class (mixins only it
uses): the LoRA adapter routes (lora_adapters.py) and the weight update routes (weight_updates.py)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import aiohttp
import httpx

from services.runtime.tls import client_ssl_context
from services.sglang_protocol.lora_adapters import LoRAAdapterRoutes, NamedAdapter
from services.sglang_protocol.releases import FLATTENED_BUCKET_SINCE, release_at_least
from services.sglang_protocol.weight_updates import WeightUpdateRoutes

PauseMode = Literal["abort", "in_place", "retract"]


class SGLangError(RuntimeError):
    def __init__(self, endpoint: str, status: int, message: str):
        super().__init__(f"{endpoint}: HTTP {status}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message

    @property
    def refused(self) -> bool:
        """The engine refused the content itself (the built-in engine's 422: weights that do not fit its
        model): sending the same again cannot succeed."""
        return self.status == 422


class EngineUnreachable(SGLangError):
    """The request did not get an answer: connection refused or reset, or the deadline passed. The
    engine may be restarting; the caller may try again (perhaps on another engine)."""

    def __init__(self, endpoint: str, message: str):
        super().__init__(endpoint, 0, message)


@dataclass
class Generation:
    """One sample's output from /generate, as the rollout needs it."""

    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # stop | length | abort
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (weight version, start, end) over output ids


class SGLangClient(LoRAAdapterRoutes, WeightUpdateRoutes):
    def __init__(self, base_url: str, timeout_s: float = 60.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = headers
        self._timeout_s = timeout_s
        # https: the server is verified (services/runtime/tls.py); True = the libraries' defaults for http
        self._ssl = client_ssl_context() if self.base_url.startswith("https://") else True
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, verify=self._ssl)
        # generation is async, many requests in flight: aiohttp, whose per-request CPU cost is a fraction of
        # httpx's async pool (docs/performance.md); the blocking control calls use httpx
        self._session: aiohttp.ClientSession | None = None
        self._pause_takes_mode: bool | None = None
        self._needs_begin_end: bool | None = None
        self._version_endpoint: str | None = None
        self._model_info: dict | None = None  # what the server says of itself, read once
        self._server_info: dict | None = None  # its server arguments, read once
        self._records_paused_version = False  # an update made while paused set its version (not SGLang 0.5.6)

    def close(self) -> None:
        self._http.close()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _post(self, endpoint: str, body: dict | None = None, timeout: float | None = None) -> httpx.Response:
        kwargs: dict[str, Any] = {"json": body} if body is not None else {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        return self._http.post(endpoint, **kwargs)

    @classmethod
    def _check(cls, endpoint: str, response: httpx.Response) -> dict:
        return cls._answer(endpoint, response.status_code, response.content)

    @staticmethod
    def _answer(endpoint: str, status: int, content: bytes) -> dict:
        """The JSON body of an answer; SGLangError for an HTTP error or `success: false`."""
        text = content.decode("utf-8", "replace")
        try:
            data = json.loads(content) if content else {}
        except ValueError:
            data = {"message": text}
        if status >= 400 or (isinstance(data, dict) and data.get("success") is False):
            message = (data.get("message") or data.get("error_message")) if isinstance(data, dict) else None
            if message is None and isinstance(data, dict) and isinstance(data.get("error"), dict):
                message = data["error"].get("message")
            raise SGLangError(endpoint, status, message or text[:500])
        return data if isinstance(data, dict) else {"data": data}

    async def _arequest(
        self,
        method: str,
        endpoint: str,
        body: dict | None = None,
        params: dict | None = None,
        read_timeout_s: float | None = None,
    ) -> dict:
        """One asynchronous call; read_timeout_s None waits as long as the answer takes (a generation)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.base_url + "/",
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl),
            )  # the rollout bounds its own concurrency
        timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout_s, sock_read=read_timeout_s)
        try:
            async with self._session.request(
                method, endpoint.lstrip("/"), json=body, params=params, timeout=timeout
            ) as response:
                content = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineUnreachable(endpoint, f"{type(exc).__name__}: {exc}") from exc
        return self._answer(endpoint, response.status, content)

    # ------------------------------------------------------------ liveness and versions

    def health(self) -> bool:
        """Alive: the server answers at all within 5 s. Asked of /get_model_info, which SGLang answers at once
        even while paused: its /health holds a paused server's answer for its 20 s probe and then says 503, so
        a short /health wait took a paused SGLang for a dead one (and left it out of the weight syncs)."""
        try:
            self._http.get("/get_model_info", timeout=5)
            return True
        except httpx.HTTPError:
            return False

    def weight_version(self) -> str:
        if self._version_endpoint is None:
            for endpoint in ("/weight_version", "/get_weight_version", "/model_info"):
                response = self._http.get(endpoint)
                if response.status_code == 200 and "weight_version" in response.json():
                    self._version_endpoint = endpoint
                    return str(response.json()["weight_version"])
            raise SGLangError("weight_version", 404, "no endpoint reports weight_version")
        return str(self._check(self._version_endpoint, self._http.get(self._version_endpoint))["weight_version"])

    async def wait_weight_version(self, newer_than: str | None, wait_s: float) -> str:
        """The version, as a long poll where the server offers one: the built-in engine answers once its
        version differs from `newer_than` (or after wait_s); SGLang ignores the parameters and answers at
        once, so a caller that got the same version back quickly should wait before asking again."""
        if self._version_endpoint is None:
            return await self._find_version_endpoint()
        params = {"newer_than": newer_than, "wait_s": str(wait_s)} if newer_than is not None and wait_s > 0 else None
        data = await self._arequest("GET", self._version_endpoint, params=params, read_timeout_s=wait_s + 10)
        return str(data["weight_version"])

    async def _find_version_endpoint(self) -> str:
        """weight_version's discovery on the event loop (never a worker thread: a rollout whose threads are all
        busy, as its agents' episodes make them while no engine answers, must still find its engine back)."""
        for endpoint in ("/weight_version", "/get_weight_version", "/model_info"):
            try:
                data = await self._arequest("GET", endpoint, read_timeout_s=min(self._timeout_s, 30.0))
            except EngineUnreachable:
                raise
            except SGLangError:
                continue  # this release has no such route
            if "weight_version" in data:
                self._version_endpoint = endpoint
                return str(data["weight_version"])
        raise SGLangError("weight_version", 404, "no endpoint reports weight_version")

    def live_weight_update(self) -> bool:
        """Whether the server loads a weight update between two steps while it keeps generating (the
        built-in engine says so in its model info), so it need not be paused for one. Asked once."""
        return bool(self._extensions().get("live_weight_update", False))

    def flat_bucket_update(self) -> bool:
        """Whether /update_weights_from_distributed takes a whole bucket as one broadcast (`flat_bucket`,
        a Sluice extension the built-in engine announces in its model info)."""
        return bool(self._extensions().get("flat_bucket_update", False))

    def gpu(self) -> str | None:
        """The UUID of the server's GPU, where it says (the built-in engine's model info); None otherwise."""
        return self._extensions().get("gpu")

    def takes_lora_adapter(self) -> bool:
        """Whether an update may be a LoRA adapter merged on load (Sluice's extension; not SGLang: docs/trainer.md)."""
        return bool(self._extensions().get("lora_adapter_update", False))

    def takes_cuda_ipc(self) -> bool:
        """Whether /update_weights_from_tensor takes a bucket by CUDA IPC handle in JSON (a Sluice extension)."""
        return bool(self._extensions().get("cuda_ipc_update", False))

    def _extensions(self) -> dict:
        """The server's model info, read once; {} where it has none. EngineUnreachable (not remembered) when it
        does not answer: taken for an engine without extensions, a stopped engine was asked the next question
        too, each costing the whole timeout, and a sync that included it failed only after several."""
        if self._model_info is None:
            try:
                self._model_info = self.model_info()
            except httpx.TransportError as exc:
                raise EngineUnreachable("model_info", f"{type(exc).__name__}: {exc}") from exc
            except (httpx.HTTPError, SGLangError, ValueError):
                self._model_info = {}
        return self._model_info

    def flattened_bucket_update(self) -> bool:
        """Whether /update_weights_from_distributed takes SGLang's `load_format: "flattened_bucket"` (the call's
        tensors back to back in one uint8 broadcast): SGLang from 0.5.6 on, by the version its server info
        reports (0.5.5 and older ignore the field and would wait for one broadcast per tensor), and the built-in
        engine, which announces flat_bucket_update and takes SGLang's form as well. Asked once."""
        return self.flat_bucket_update() or release_at_least(self._server_args().get("version"), FLATTENED_BUCKET_SINCE)

    def served_dtype(self) -> str | None:
        """The dtype the server keeps its weights in: the built-in engine's `weights_dtype` (model info), else
        the `dtype` of SGLang's server arguments (/server_info, /get_server_info) unless it is "auto"; None when
        neither says. A publish sends floating weights in it (services/dcs/sync/precision.py)."""
        declared = self._extensions().get("weights_dtype")
        if declared is None:
            declared = self._server_args().get("dtype")
        return declared if declared in ("float32", "bfloat16", "float16", "float64") else None

    def _server_args(self) -> dict:
        """SGLang's server info (its server arguments and `version`), read once; {} where there is none."""
        if self._server_info is None:
            try:
                self._server_info = self._first_found(("/server_info", "/get_server_info")) or {}
            except httpx.TransportError as exc:  # as _extensions: not an answer, not remembered
                raise EngineUnreachable("server_info", f"{type(exc).__name__}: {exc}") from exc
            except (httpx.HTTPError, ValueError):
                self._server_info = {}
        return self._server_info

    def _first_found(self, endpoints: Sequence[str]) -> dict | None:
        """The JSON object of the first of `endpoints` (the names a route has in different releases) that answers
        200; None when none does."""
        for endpoint in endpoints:
            response = self._http.get(endpoint)
            if response.status_code == 200:
                data = response.json()
                return data if isinstance(data, dict) else {}
        return None

    def model_info(self) -> dict:
        info = self._first_found(("/model_info", "/get_model_info"))
        if info is None:
            raise SGLangError("model_info", 404, "no model_info endpoint")
        return info

    # ------------------------------------------------------------ generation

    async def generate(self, input_ids: Sequence[int], sampling_params: dict, rid: str | None = None) -> Generation:
        """One sample with output-token log-probs. A request aborted by a pause comes back with its
        partial output and finish_reason "abort" (the caller resubmits the continuation)."""
        return (await self.generate_batch([input_ids], [sampling_params], None if rid is None else [rid]))[0]

    async def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        sampling_params: Sequence[dict],
        rids: Sequence[str] | None = None,
        adapter: NamedAdapter | None = None,
    ) -> list[Generation]:
        """Several samples in one /generate call (one input, sampling_params and rid each), in input order.
        Identical inputs, such as the samples of one prompt, share their prefill: the built-in engine copies
        the prompt's KV, SGLang's radix cache reuses it. `adapter`: the LoRA adapter they come from, named
        (`lora_path`) where the server does not merge adapters into its weights (lora_adapters.py)."""
        body: dict[str, Any] = {
            "input_ids": [list(x) for x in inputs],
            "sampling_params": list(sampling_params),
            "return_logprob": True,
        }
        if rids is not None:
            body["rid"] = list(rids)
        named = adapter if adapter is not None and await self.names_adapters() else None
        if named is not None:
            body["lora_path"] = named.name
        data = (await self._arequest("POST", "/generate", body)).get("data")
        if not isinstance(data, list) or len(data) != len(inputs):
            raise SGLangError("/generate", 200, f"expected {len(inputs)} results in a list")
        generations = [self._generation(item) for item in data]
        return generations if named is None else self.from_adapter(generations, named)

    async def generate_text(self, text: str, sampling_params: dict) -> str:
        """One completion of a text prompt, tokenized by the server as it is (no chat template): its text (a
        judge model's answer: services/rollout/rewards/model_judge.py)."""
        data = await self._arequest("POST", "/generate", {"text": text, "sampling_params": sampling_params})
        if not isinstance(data.get("text"), str):
            raise SGLangError("/generate", 200, "the answer carries no text")
        return data["text"]

    @staticmethod
    def _generation(data: dict) -> Generation:
        meta = data.get("meta_info") or {}
        output_ids = [int(t) for t in data.get("output_ids") or []]
        log_probs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(log_probs) != len(output_ids):
            raise SGLangError("/generate", 200, f"{len(output_ids)} output ids but {len(log_probs)} log-probs")
        reason = (meta.get("finish_reason") or {}).get("type", "length")
        spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []]
        if not spans and output_ids:
            spans = [(str(meta.get("weight_version", "default")), 0, len(output_ids))]
        return Generation(output_ids, log_probs, reason, spans)

    # ------------------------------------------------------------ generation control

    def pause(self, mode: PauseMode = "abort") -> None:
        if self._pause_takes_mode is not False:
            response = self._post("/pause_generation", {"mode": mode})
            if response.status_code < 400:
                self._pause_takes_mode = True
                return
            if self._pause_takes_mode is True or response.status_code not in (400, 404, 405, 422):
                self._check("/pause_generation", response)
            self._pause_takes_mode = False  # 0.5.5: no body, always aborts
        self._check("/pause_generation", self._post("/pause_generation"))

    def continue_generation(self) -> None:
        self._check("/continue_generation", self._post("/continue_generation", {}))

    def flush_cache(self, deadline_s: float = 30.0) -> None:
        """400 while requests run: retried until the deadline."""
        end = time.monotonic() + deadline_s
        while True:
            response = self._post("/flush_cache")
            if response.status_code < 400:
                return
            if time.monotonic() > end:
                self._check("/flush_cache", response)
            time.sleep(0.2)
