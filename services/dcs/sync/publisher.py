"""The trainer's side of a weight sync: publish version V and broadcast it bucket by bucket.

    metadata : lay tensors out in buckets, get the sync group for the live receivers from DCS,
               publish the metadata (with the group) so receivers start joining
    pack     : copy tensors into flat bucket k+1 on a worker thread ...
    broadcast: ... while bucket k is broadcast (rank 0 is the only source)

Rollout engines in the group are driven through the SGLang protocol (services/dcs/sync/engine_calls.py): pause (not
with pause mode "none", nor with "auto" for an engine that loads updates between steps while it generates: the
built-in engine), init the update group once per group, per bucket an /update_weights_from_distributed call while
the bucket is broadcast, and /continue_generation, in a finally, to every engine it paused. The whole group uses
one transfer, the widest every engine takes: one broadcast per bucket in Sluice's layout (the built-in engine's
`flat_bucket`) or in SGLang's (`flattened_bucket`, SGLang 0.5.6 on), else one broadcast per tensor.
Floating tensors travel in the dtype the receivers serve (services/dcs/sync/precision.py), cast bucket by bucket
on the trainer's side; an engine that refuses the weights themselves (they do not fit its model) marks the result
`refused`, which no resend can fix. Every phase has a deadline; a failure closes the group (the next sync asks for
a new one, without members that died) and is reported to DCS. The result carries per-phase seconds and bytes.
A LoRA run's adapter goes to SGLang engines as files they load through SGLang's LoRA routes instead, with no
broadcast and no pause (services/dcs/sync/adapter_publish.py). The broadcast path itself is a part of
WeightPublisher in a module of its own (services/dcs/sync/weight_broadcast.py)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from services.dcs.sync.adapter_publish import AdapterFiles, AdapterRefused
from services.dcs.sync.coordinator import PublishingCoordinator
from services.dcs.sync.messages import SyncGroupRequest, SyncReport, WeightMetadata
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.backend_choice import ReceiverPlace, choose_backend, gpu_uuid
from services.dcs.sync.bucket_packing import BucketPacking
from services.dcs.sync.engine_calls import SyncEngines
from services.dcs.sync.layout import WeightStream, plan_buckets
from services.dcs.sync.unresponsive import UnresponsiveEngines
from services.dcs.sync.weight_broadcast import WeightBroadcast
from services.runtime.processes import free_port
from services.sglang_protocol.client import EngineUnreachable, SGLangError

log = logging.getLogger(__name__)
GROUP_MAX_AGE_S = 5.0  # a prefetched sync group older than this is asked for again (membership may have moved)


@dataclass
class SyncResult:
    version: int
    ok: bool
    group: str = ""
    world_size: int = 0
    bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    announced: bool = False  # the coordinator recorded the version (receivers may have started on it)
    engines: list[str] = field(default_factory=list)  # node ids of the engines that loaded it (when ok): reported
    refused: bool = False  # an engine refused the weights themselves (they do not fit its model): no resend helps
    engine_error: bool = False  # an engine answered with an error (it is up: not a network fault)
    wire_dtype: str = ""  # the dtype floating tensors travelled in (precision.py)
    backend: str = ""  # gloo, nccl or ipc (backend_choice.py)
    transfer: str = ""  # how buckets travelled: flat_buckets, flattened_bucket, per_tensor, cuda_ipc (engine_calls.py)


class UnusableBackend(ValueError):
    """The asked sync backend cannot reach this group's receivers (backend_choice.py): no resend can help."""


class SyncFailed(RuntimeError):
    def __init__(self, result: SyncResult):
        super().__init__(f"weight sync of version {result.version} failed: {result.error}")
        self.result = result


class WeightPublisher(WeightBroadcast):
    def __init__(
        self,
        dcs: PublishingCoordinator,
        node_id: str,
        master_address: str,
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 60.0,
        receiver_roles: Iterable[str] = ("engine", "actor_fwd", "reference"),
        backend: str = "gloo",
        engine_role: str = "engine",
        pause_mode: str = "abort",
        *,
        run_id: str,
        device: str = "cpu",
        adapter_dir: str | None = None,
    ):
        """`adapter_dir`: where a LoRA trainer writes its adapters for SGLang engines to load (adapter_publish.py)."""
        self.dcs = dcs
        self.run_id = run_id  # the run whose versions, group and engines these are
        self.node_id = node_id
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.receiver_roles = list(receiver_roles)
        self.adapter_scaling: float | None = None  # set by a LoRA trainer: what it publishes is an adapter
        self.adapter_config: dict | None = None  # and its peft adapter_config.json (SGLang engines read it)
        self.adapter_dir = adapter_dir
        self.backend = backend  # as asked: auto, gloo, nccl or ipc (backend_choice.py)
        self.device = device  # the trainer's: where the weights are, and where nccl/ipc buckets are staged
        self._trainer_gpu = gpu_uuid(device)
        self._group_backend = backend if backend != "auto" else ("nccl" if self._trainer_gpu else "gloo")
        self.engine_role = engine_role
        self._group: BroadcastGroup | None = None
        self._lock = threading.Lock()
        self._prefetched: tuple | None = None  # (asked at, request, future answer) of prefetch_group
        self._failed = False
        self._packing = BucketPacking()
        self._http = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-http")
        self.engines = SyncEngines(self._http, timeout_s, pause_mode, engine_role, dcs.token)
        # reports go out in order, off the publishing path: the next step need not wait for one
        self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync-report")
        self.unresponsive = UnresponsiveEngines(self._http, self.engines.client)

    def close(self) -> None:
        self._drop_group()
        self._packing.close()
        self._http.shutdown(wait=False)
        self._reporter.shutdown(wait=True)  # the last reports still reach the coordinator

    def left_out(self) -> list[str]:
        """Node ids of the engines this publisher leaves out of its syncs because they have not answered since
        (unresponsive.py): asking readmits those that did, and asks the others again in the background."""
        return self.unresponsive.unanswered()

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()  # a group that saw a failure is not reused
            self._group = None
        self.engines.forget()

    def publish(
        self, named: Iterable[tuple[str, torch.Tensor]] | WeightStream, version: int, announce: bool = True
    ) -> SyncResult:
        """Broadcast `named` as `version` to the current group of receiver roles. announce=False sends an
        already published version again without recording it with the coordinator: only for engines
        (driven over HTTP, they do not read the coordinator's metadata), e.g. one that restarted. A
        WeightStream is taken bucket by bucket as the buckets are packed, and closed whatever happens."""
        if not isinstance(named, WeightStream):
            return self._publish(list(named), version, announce, None)
        try:
            return self._publish(named.specs(), version, announce, named)
        finally:
            named.close()

    def _publish(self, named: list, version: int, announce: bool, stream: WeightStream | None) -> SyncResult:
        result = SyncResult(version=version, ok=False)
        t0 = time.perf_counter()
        self.unresponsive.readmit()
        try:
            group_spec = self._resolved_group()
            result.group, result.world_size, result.backend = group_spec.name, group_spec.world_size, group_spec.backend
            if not announce and any(m.role != self.engine_role for m in group_spec.members[1:]):
                raise ValueError("an unannounced publish can only go to engines")
            self.engines.lora_scaling = self.adapter_scaling
            if self._adapter_by_name():
                self._publish_adapter(group_spec, named, stream, version, announce, result, t0)
            else:
                self._broadcast(group_spec, named, stream, version, announce, result, t0)
            result.ok = True
            result.engines = [m.node_id for m in self.engines.members]
        except Exception as exc:
            self._failed_with(exc, result)
        result.seconds["total"] = time.perf_counter() - t0
        self._reporter.submit(self._report, result)
        if not result.ok:
            raise SyncFailed(result)
        return result

    def _adapter_by_name(self) -> bool:
        """A LoRA publish whose engines load the adapter by name (SGLang's LoRA routes: adapter_publish.py)
        rather than merging a broadcast one (the built-in engine); UnusableBackend when they do neither."""
        if self.adapter_scaling is None:
            return False
        try:
            by_name = self.engines.adapter_route()
        except ValueError as exc:
            raise UnusableBackend(str(exc)) from exc
        if by_name and (self.adapter_dir is None or self.adapter_config is None):
            raise UnusableBackend(
                "a LoRA run's SGLang engines load the adapter from files, and this trainer has no "
                "directory to write them to (its --adapter-dir, or --output-dir)"
            )
        return by_name

    def _publish_adapter(
        self,
        group_spec,
        named: list,
        stream: WeightStream | None,
        version: int,
        announce: bool,
        result: SyncResult,
        t0: float,
    ) -> None:
        """The adapter to every engine through SGLang's LoRA routes (adapter_publish.py): its files written,
        the version announced (nothing is broadcast: transfer adapter_files), then loaded by each engine."""
        assert self.adapter_dir is not None and self.adapter_config is not None  # _adapter_by_name
        files = AdapterFiles(self.run_id, self.adapter_dir, self.adapter_config, self.timeout_s)
        entries, sizes = plan_buckets(named, self.bucket_bytes)
        result.transfer, result.bytes = "adapter_files", sum(sizes)
        path = files.write(version, dict(stream.take(len(named)) if stream is not None else named))
        result.seconds["pack"] = time.perf_counter() - t0
        if announce:
            self.dcs.publish_weights(
                self.run_id,
                WeightMetadata(
                    version=version,
                    tensors=entries,
                    bucket_bytes=sizes,
                    publisher=self.node_id,
                    sync_group=group_spec,
                    transfer="adapter_files",
                ),
            )
            result.announced = True
        loading = time.perf_counter()
        try:
            files.load(self.engines, version, path)
        except AdapterRefused as exc:
            raise UnusableBackend(str(exc)) from exc
        result.seconds["engine_load"] = time.perf_counter() - loading

    def _failed_with(self, exc: Exception, result: SyncResult) -> None:
        result.refused = isinstance(exc, UnusableBackend) or (isinstance(exc, SGLangError) and exc.refused)
        result.engine_error = isinstance(exc, SGLangError) and not isinstance(exc, EngineUnreachable)
        self._failed = True
        self.unresponsive.after_failure(self.engines.current())
        self._drop_group()
        result.error = f"{type(exc).__name__}: {exc}"

    def _resolved_group(self):
        """The sync group, with the transfer `auto` (or the asked backend) picks for its members (backend_choice.py):
        asked again, once, when the members call for another backend than the group was made with."""
        spec = self._sync_group()
        for attempt in range(2):
            self.engines.select(spec, lambda: self.dcs.topology())
            clients = self.engines.clients
            places = [
                ReceiverPlace(m.role, clients[m.node_id].gpu(), clients[m.node_id].takes_cuda_ipc())
                if m.role == self.engine_role
                else ReceiverPlace(m.role, m.gpu)
                for m in spec.members
                if m.node_id != self.node_id
            ]
            try:
                chosen = choose_backend(self.backend, self._trainer_gpu, places)
            except ValueError as exc:
                raise UnusableBackend(str(exc)) from exc
            if chosen == spec.backend or attempt:
                return spec
            self._group_backend = chosen
            spec = self.dcs.sync_group(self.run_id, self._group_request(self.receiver_roles))
        return spec

    def _group_request(self, receiver_roles: list[str]) -> SyncGroupRequest:
        return SyncGroupRequest(
            source_node=self.node_id,
            master_address=self.master_address,
            master_port=free_port(self.master_address),  # used only if DCS makes a new group
            receiver_roles=list(receiver_roles),
            backend=self._group_backend,
            new_group=self._failed,
            exclude_nodes=self.unresponsive.excluded(),
        )

    def prefetch_group(self, receiver_roles: list[str]) -> None:
        """Ask the coordinator now, on a worker thread, for the group of the next publish to `receiver_roles`
        (the trainer calls this as a step starts training), so that the publish skips that round trip on its way
        to the receivers. A publish takes the answer only if it is for the same roles, younger than
        GROUP_MAX_AGE_S and no sync failed since; otherwise it asks again, as it does without a prefetch."""
        request = self._group_request(receiver_roles)
        with self._lock:
            self._prefetched = (time.monotonic(), request, self._http.submit(self.dcs.sync_group, self.run_id, request))

    def _sync_group(self):
        with self._lock:
            prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            at, request, answer = prefetched
            if (
                not self._failed
                and request.receiver_roles == list(self.receiver_roles)
                and request.exclude_nodes == self.unresponsive.excluded()
                and request.backend == self._group_backend
                and time.monotonic() - at <= GROUP_MAX_AGE_S
            ):
                try:
                    return answer.result(timeout=self.timeout_s)
                except Exception:  # asked again below, where a coordinator error is raised
                    pass
        return self.dcs.sync_group(self.run_id, self._group_request(self.receiver_roles))

    def resume_engines(self) -> int:
        """Send /continue_generation to every live engine: a publisher that died between pausing the
        engines and resuming them (in its `finally`) leaves them paused. Only this run's engines (another run's
        are its own trainer's). Returns how many answered."""
        return self.engines.resume_all(self.dcs.topology(), self.run_id)

    def reported(self, timeout_s: float | None = None) -> None:
        """Return once the reports of every sync so far have reached the coordinator (or failed to): from then on
        its record of the version each engine holds (GET /v1/runs/{run_id}/engines) includes those syncs."""
        self._reporter.submit(lambda: None).result(timeout=timeout_s if timeout_s is not None else self.timeout_s)

    def _report(self, result: SyncResult) -> None:
        """The sync's report, naming the engines that loaded its version: the coordinator's one record of what
        each engine holds (services/dcs/state.py K:held) is set from it."""
        try:
            self.dcs.report_sync(
                self.run_id,
                SyncReport(
                    version=result.version,
                    group=result.group or "none",
                    node_id=self.node_id,
                    ok=result.ok,
                    error=result.error,
                    seconds=result.seconds,
                    bytes=result.bytes,
                    engines=result.engines,
                ),
            )
        except Exception as exc:  # reporting must not turn a good sync into a failure
            log.warning("could not report sync: %s", exc, extra={"error": str(exc)})
