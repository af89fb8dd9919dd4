"""The rollout engines of a sync group, driven for the trainer's WeightPublisher through the SGLang protocol
(services/sglang_protocol/client.py, the only code that knows its wire form): pause and resume, joining the
update group, the /begin ... /end_weight_update bracket, and each bucket's update call.

How a bucket travels is one choice for the whole group (`SyncEngines.transfer`), since one broadcast serves
every member:

    cuda_ipc          an ipc group: the bucket by CUDA IPC handle to engines on the trainer's GPU, no broadcast
    flat_buckets      every engine takes Sluice's `flat_bucket` extension (the built-in engine): one broadcast
                      per bucket, laid out by layout.plan_buckets (8-byte-aligned offsets)
    flattened_bucket  every engine takes SGLang's `load_format: "flattened_bucket"` (SGLang 0.5.6 on, and the
                      built-in engine): one broadcast per bucket, its tensors back to back as SGLang's
                      FlattenedTensorBucket allocates them from the call's names, dtypes and shapes
                      (layout.plan_buckets(packed=True))
    per_tensor        some engine takes neither (SGLang before 0.5.6): one broadcast per tensor, in order

Sluice's own receivers take every form but cuda_ipc from the published metadata: one broadcast per bucket at the
published offsets (the coordinator's `flat_buckets`, which flattened_bucket is too), or one per tensor.

A LoRA run's adapter reaches built-in engines in these forms (they merge it: lora_scaling); SGLang servers load
it by name from files instead, with no broadcast (adapter_route; services/dcs/sync/adapter_publish.py)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Literal, cast, get_args

import torch

from services.dcs.sync.cuda_ipc import share
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import TORCH_DTYPES
from services.sglang_protocol.client import PauseMode, SGLangClient

log = logging.getLogger(__name__)
Transfer = Literal["cuda_ipc", "flat_buckets", "flattened_bucket", "per_tensor"]
# the trainer's pause_mode: SGLang's modes, none, or auto (SyncEngines.mode)
EnginePause = Literal["auto", "abort", "in_place", "retract", "none"]
# what the coordinator's metadata says to Sluice's receivers: a flattened bucket is one broadcast per bucket
PUBLISHED_TRANSFER = {
    "cuda_ipc": "cuda_ipc",
    "flat_buckets": "flat_buckets",
    "flattened_bucket": "flat_buckets",
    "per_tensor": "per_tensor",
}


class SyncEngines:
    def __init__(
        self, http: ThreadPoolExecutor, timeout_s: float, pause_mode: str, engine_role: str, token: str | None
    ):
        self._http = http
        self.timeout_s = timeout_s
        if pause_mode not in get_args(EnginePause):
            raise ValueError(f"pause_mode {pause_mode!r}: one of {', '.join(get_args(EnginePause))}")
        self.pause_mode = cast(EnginePause, pause_mode)
        self.engine_role = engine_role
        self._token = token  # the stack's one token (the coordinator's)
        self.clients: dict[str, SGLangClient] = {}  # node id -> client, for the current group
        self.members: list = []  # the current group's engine members
        self.lora_scaling: float | None = None  # the publish is a LoRA adapter: its alpha / r (publisher.py)

    def client(self, url: str) -> SGLangClient:
        return SGLangClient(url, timeout_s=self.timeout_s, api_key=self._token)

    def select(self, spec, topology: Callable) -> None:
        """The group's engines become the current ones; those not known yet are looked up in `topology()` (the
        usual publish knows them all: no topology round trip)."""
        self.members = [m for m in spec.members if m.role == self.engine_role]
        missing = [m for m in self.members if m.node_id not in self.clients]
        if not missing:
            return
        nodes = {n.node_id: n for ns in topology().roles.values() for n in ns}
        for m in missing:
            url = nodes[m.node_id].url()
            if url is None:
                raise RuntimeError(f"engine node {m.node_id} registered no 'http' or 'https' port")
            self.clients[m.node_id] = self.client(url)

    def current(self) -> dict[str, SGLangClient]:
        return {m.node_id: self.clients[m.node_id] for m in self.members if m.node_id in self.clients}

    def forget(self) -> None:
        for engine in self.clients.values():
            engine.close()
        self.clients = {}

    def mode(self, engine: SGLangClient) -> PauseMode | Literal["none"]:
        """How this engine is paused for an update: the configured mode; "auto" = none for an engine that
        loads updates between steps while generating (the built-in engine), abort for others (SGLang)."""
        if self.pause_mode == "auto":
            return "none" if engine.live_weight_update() else "abort"
        return self.pause_mode

    def _flush(self, engine: SGLangClient) -> bool:
        return self.mode(engine) not in ("in_place", "none")  # their requests still hold the old weights' KV

    def each(self, call: Callable[[object, SGLangClient], object]) -> None:
        """Run call(member, client) for every engine concurrently; raise the first failure."""
        futures = [self._http.submit(call, m, self.clients[m.node_id]) for m in self.members]
        for f in futures:  # bounded: an engine that stopped answering fails the sync, it does not hang it
            f.result(timeout=self.timeout_s + 5)

    def each_quietly(self, call: Callable[[SGLangClient], object]) -> None:
        """call(client) for every engine, on a failed sync's way out: errors are logged, not raised."""
        try:
            self.each(lambda m, e: call(e))
        except Exception as exc:
            log.warning("an engine did not take the end of a failed update", extra={"error": repr(exc)})

    def pause(self, paused: list[SGLangClient]) -> None:
        """Pause every engine whose mode is not "none", adding each paused one to `paused` as it is."""

        def pause_one(_: object, engine: SGLangClient) -> None:
            mode = self.mode(engine)
            if mode != "none":
                engine.pause(mode)
                paused.append(engine)

        self.each(pause_one)

    @staticmethod
    def resume(paused: list[SGLangClient]) -> None:
        for engine in paused:  # always resume generation, whatever happened
            try:
                engine.continue_generation()
            except Exception as exc:
                log.warning("could not resume an engine", extra={"engine": engine.base_url, "error": str(exc)})

    def adapter_route(self) -> bool:
        """How a LoRA publish reaches the group's engines: True when every one loads adapters by name through
        SGLang's LoRA routes (SGLang launched with --enable-lora: adapter_publish.py), False when every one
        merges them into its weights (the built-in engine: the broadcast). ValueError naming the engines that do
        neither, or when the group mixes the two."""
        engines = [self.clients[m.node_id] for m in self.members]
        merging = [e.base_url for e in engines if e.takes_lora_adapter()]
        by_name = [e.base_url for e in engines if e.base_url not in merging and e.serves_lora_adapters()]
        unable = [e.base_url for e in engines if e.base_url not in merging + by_name]
        if unable:
            raise ValueError(
                f"a LoRA run (trainer.lora) publishes only its adapter, which these engines do not take: "
                f"{', '.join(unable)}; an SGLang server takes it when launched with --enable-lora, "
                "--max-lora-rank and --lora-target-modules (docs/trainer.md)"
            )
        if merging and by_name:
            raise ValueError(
                f"a LoRA run's engines must all merge the adapter (built-in engines: {', '.join(merging)}) "
                f"or all load it by name (SGLang servers: {', '.join(by_name)}), not both"
            )
        return bool(by_name)

    def transfer(self, backend: str) -> Transfer:
        """The group's transfer (module docstring): the widest form every engine takes."""
        if backend == "ipc":
            return "cuda_ipc"
        engines = [self.clients[m.node_id] for m in self.members]
        if all(e.flat_bucket_update() for e in engines):
            return "flat_buckets"
        if all(e.flattened_bucket_update() for e in engines):
            return "flattened_bucket"
        return "per_tensor"

    def join(self, spec) -> list[Future]:
        """Every engine's /init_weights_update_group, which blocks until everyone joined: the caller joins as rank
        0 while these run, then waits on them."""
        return [
            self._http.submit(
                self.clients[m.node_id].init_weights_update_group,
                spec.master_address,
                spec.master_port,
                m.rank,
                spec.world_size,
                spec.name,
                spec.backend,
                self.timeout_s,
            )
            for m in self.members
        ]

    def send_bucket(
        self, group: BroadcastGroup | None, bucket, flat: torch.Tensor, size: int, transfer: Transfer, version: str
    ) -> None:
        """Bucket `bucket` (its entries; `flat` packed in the transfer's layout) to every engine, and to the
        group's other receivers by the same broadcasts."""
        if transfer == "cuda_ipc":
            self._share_bucket(bucket, flat, version)
            return
        if group is None:  # every transfer but cuda_ipc broadcasts
            raise ValueError(f"a {transfer} transfer needs the update group's broadcast; there is none")
        flat_spec = {"offsets": [e.offset for e in bucket], "nbytes": size} if transfer == "flat_buckets" else None
        load_format = "flattened_bucket" if transfer == "flattened_bucket" else None
        # the engines' HTTP calls return only after receiving: send them first, then broadcast
        calls = [
            self._http.submit(
                engine.update_weights_from_distributed,
                [e.name for e in bucket],
                [e.dtype for e in bucket],
                [e.shape for e in bucket],
                group.name,
                version,
                self._flush(engine),
                self.timeout_s,
                flat_spec,
                load_format,
                self.lora_scaling,
            )
            for engine in (self.clients[m.node_id] for m in self.members)
        ]
        if transfer == "per_tensor":
            for e in bucket:  # typed, as the engine allocates it (NCCL matches dtype and count)
                group.broadcast(flat[e.offset : e.offset + e.nbytes].view(TORCH_DTYPES[e.dtype]), 0)
        else:  # one uint8 broadcast of the whole bucket, as both bucket forms receive it
            group.broadcast(flat, 0)
        for call in calls:
            call.result(timeout=self.timeout_s)

    def _share_bucket(self, bucket, flat: torch.Tensor, version: str) -> None:
        """The bucket to every engine on this GPU by CUDA IPC handle; they answer once they copied it out, so the
        staging buffer may be packed again after."""
        shared = {
            "shared": share(flat),
            "names": [e.name for e in bucket],
            "dtypes": [e.dtype for e in bucket],
            "shapes": [e.shape for e in bucket],
            "offsets": [e.offset for e in bucket],
        }
        calls = [
            self._http.submit(
                engine.update_weights_from_tensor,
                shared,
                version,
                self._flush(engine),
                self.timeout_s,
                self.lora_scaling,
            )
            for engine in (self.clients[m.node_id] for m in self.members)
        ]
        for call in calls:
            call.result(timeout=self.timeout_s)

    def resume_all(self, topology, run_id: str) -> int:
        """Send /continue_generation to every live engine of `run_id` in `topology` (another run's are its own
        trainer's). Returns how many answered."""
        resumed = 0
        for node in topology.roles.get(self.engine_role, []):
            url = node.url()
            if not node.alive or url is None or node.run_id != run_id:
                continue
            engine = self.client(url)
            try:
                engine.continue_generation()
                resumed += 1
            except Exception as exc:
                log.warning("could not resume engine", extra={"node_id": node.node_id, "error": str(exc)})
            finally:
                engine.close()
        return resumed
