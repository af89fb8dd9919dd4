"""SGLang's weight update routes as SGLangClient drives them (a part of that class, in its own module): the
weight publisher (services/dcs/sync) joins an engine to its broadcast group, brackets an update where the release
wants it, sends the buckets, and makes sure the engine then says the version it loaded.

    POST /init_weights_update_group      join the broadcast group (blocks until every member joined)
    POST /destroy_weights_update_group   leave it
    POST /begin_weight_update, /end_weight_update   the bracket around an update (SGLang 0.5.23; 404 before)
    POST /update_weights_from_distributed           tensors by broadcast: one per tensor, or one per bucket
                                                    (Sluice's `flat_bucket`, SGLang's "flattened_bucket")
    POST /update_weights_from_tensor     a bucket by CUDA IPC handle (Sluice's JSON form only)"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import httpx


class _Client(Protocol):
    """What these calls use of SGLangClient (the class they are a part of)."""

    _needs_begin_end: bool | None
    _records_paused_version: bool

    def _post(self, endpoint: str, body: dict | None = None, timeout: float | None = None) -> httpx.Response: ...

    def _check(self, endpoint: str, response: httpx.Response) -> dict: ...

    def weight_version(self) -> str: ...

    def set_weight_version(self, version: str) -> None: ...


class WeightUpdateRoutes:
    """SGLangClient's calls of SGLang's weight update routes (module docstring)."""

    _needs_begin_end: bool | None  # SGLangClient's: whether its server wants the bracket, once known
    _records_paused_version: bool  # SGLangClient's: an update made while paused set its version

    def init_weights_update_group(
        self: _Client,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout: float | None = None,
    ) -> None:
        """Blocks until every member joined: call it concurrently with the trainer's own join."""
        self._check(
            "/init_weights_update_group",
            self._post(
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": rank_offset,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
                timeout=timeout,
            ),
        )

    def destroy_weights_update_group(self: _Client, group_name: str) -> None:
        self._check(
            "/destroy_weights_update_group", self._post("/destroy_weights_update_group", {"group_name": group_name})
        )

    def begin_weight_update(self: _Client) -> None:
        """0.5.23 wants updates bracketed; older releases have no such endpoint (404: remembered)."""
        if self._needs_begin_end is False:
            return
        response = self._post("/begin_weight_update", {})
        if response.status_code == 404:
            self._needs_begin_end = False
            return
        self._check("/begin_weight_update", response)
        self._needs_begin_end = True

    def end_weight_update(self: _Client) -> None:
        if self._needs_begin_end:
            self._check("/end_weight_update", self._post("/end_weight_update", {}))

    def ensure_weight_version(self: _Client, version: str) -> None:
        """After a paused update that should have set `version`: set it where the server says another (SGLang
        0.5.6 records no weight_version for an update made while paused; /update_weight_version sets it). A
        server found to record it is not asked again (one round trip fewer per update)."""
        if self._records_paused_version:
            return
        if self.weight_version() == version:
            self._records_paused_version = True
            return
        self.set_weight_version(version)

    def update_weights_from_distributed(
        self: _Client,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool = True,
        timeout: float | None = None,
        flat_bucket: dict | None = None,
        load_format: str | None = None,
        lora_scaling: float | None = None,
    ) -> None:
        """Returns after the engine received and loaded the named tensors: one broadcast per tensor, in this
        order; or one broadcast of the whole bucket, with `flat_bucket={"offsets", "nbytes"}` (a server that says
        flat_bucket_update) or `load_format="flattened_bucket"` (the tensors back to back: a server that says
        flattened_bucket_update). `lora_scaling`: they are a LoRA adapter (lora_adapter_update)."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
            **({"lora_scaling": lora_scaling} if lora_scaling else {}),
        }
        if flat_bucket is not None:
            body["flat_bucket"] = flat_bucket
        if load_format is not None:
            body["load_format"] = load_format
        self._check(
            "/update_weights_from_distributed", self._post("/update_weights_from_distributed", body, timeout=timeout)
        )

    def update_weights_from_tensor(
        self: _Client,
        bucket: dict,
        weight_version: str | None,
        flush_cache: bool = True,
        timeout: float | None = None,
        lora_scaling: float | None = None,
    ) -> None:
        """A flat bucket on the server's GPU, by CUDA IPC handle (`bucket`: services/dcs/sync/cuda_ipc.py's
        description plus the tensors' names, dtypes, shapes and offsets); returns once the server copied and
        loaded it. Sluice's JSON form (load_format sluice_cuda_ipc): SGLang's own form is pickled, never sent."""
        body = {
            "load_format": "sluice_cuda_ipc",
            "bucket": bucket,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
            **({"lora_scaling": lora_scaling} if lora_scaling else {}),
        }
        self._check("/update_weights_from_tensor", self._post("/update_weights_from_tensor", body, timeout=timeout))
