"""The trainer's side of a weight sync: publish version V and broadcast it bucket by bucket.

    metadata : lay tensors out in buckets, get the sync group for the live receivers from DCS,
               publish the metadata (with the group) so receivers start joining
    pack     : copy tensors into flat bucket k+1 on a worker thread ...
    broadcast: ... while bucket k is broadcast (rank 0 is the only source)

Rollout engines in the group are driven through the SGLang protocol (docs/engine.md): pause (not with pause
mode "none", nor with "auto" for an engine that loads updates between steps while it generates: the built-in
engine), init the update group once per group, per bucket an /update_weights_from_distributed call naming the
bucket's tensors while the same tensors are broadcast one by one in the same order (or, when every engine
takes whole buckets (the built-in engine's `flat_bucket` extension), the bucket as one broadcast), and
/continue_generation, in a finally, to every engine it paused. The whole group uses one transfer: per tensor
when any engine needs it, otherwise one broadcast per flat bucket.
Floating tensors travel in the dtype the receivers serve (services/dcs/sync/precision.py), cast bucket by bucket
on the trainer's side; an engine that refuses the weights themselves (they do not fit its model) marks the result
`refused`, which no resend can fix. Every phase has a deadline; a failure closes the group (the next sync asks for a new one, without
members that died) and is reported to DCS. The result carries per-phase seconds and bytes."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from services.dcs.client import DCSClient
from services.dcs.models import SyncGroupRequest, SyncReport, WeightMetadata
from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.backend_choice import ReceiverPlace, choose_backend, gpu_uuid
from services.dcs.sync.bucket_packing import BucketPacking, bucket_tensors
from services.dcs.sync.cuda_ipc import share
from services.dcs.sync.layout import TORCH_DTYPES, WeightStream, plan_buckets
from services.dcs.sync.precision import FLOATING, wire_dtype
from services.dcs.sync.unresponsive import UnresponsiveEngines
from services.runtime.processes import free_port
from services.sglang_protocol.client import EngineUnreachable, SGLangClient, SGLangError

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
    engines: list[str] = field(default_factory=list)  # node ids of the engines that loaded it (when ok)
    refused: bool = False  # an engine refused the weights themselves (they do not fit its model): no resend helps
    engine_error: bool = False  # an engine answered with an error (it is up: not a network fault)
    wire_dtype: str = ""  # the dtype floating tensors travelled in (precision.py)
    backend: str = ""  # gloo, nccl or ipc (backend_choice.py)


class UnusableBackend(ValueError):
    """The asked sync backend cannot reach this group's receivers (backend_choice.py): no resend can help."""


class SyncFailed(RuntimeError):
    def __init__(self, result: SyncResult):
        super().__init__(f"weight sync of version {result.version} failed: {result.error}")
        self.result = result


class WeightPublisher:
    def __init__(self, dcs: DCSClient, node_id: str, master_address: str, bucket_bytes: int = 64 << 20,
                 timeout_s: float = 60.0, receiver_roles: Iterable[str] = ("engine", "actor_fwd", "reference"),
                 backend: str = "gloo", engine_role: str = "engine", pause_mode: str = "abort", *, run_id: str,
                 device: str = "cpu"):
        self.dcs = dcs
        self.run_id = run_id  # the run whose versions, group and engines these are
        self.node_id = node_id
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.receiver_roles = list(receiver_roles)
        self.backend = backend  # as asked: auto, gloo, nccl or ipc (backend_choice.py)
        self.device = device  # the trainer's: where the weights are, and where nccl/ipc buckets are staged
        self._trainer_gpu = gpu_uuid(device)
        self._group_backend = backend if backend != "auto" else ("nccl" if self._trainer_gpu else "gloo")
        self.engine_role = engine_role
        self.pause_mode = pause_mode
        self._engines: dict[str, SGLangClient] = {}  # node id -> client, for the current group
        self._group: BroadcastGroup | None = None
        self._current_engines: list = []
        self._lock = threading.Lock()
        self._prefetched: tuple | None = None  # (asked at, request, future answer) of prefetch_group
        self._failed = False
        self._packing = BucketPacking()
        self._http = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-http")
        # reports go out in order, off the publishing path: the next step need not wait for one
        self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync-report")
        self.unresponsive = UnresponsiveEngines(self._http, self._engine_client)

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
        for engine in self._engines.values():
            engine.close()
        self._engines = {}

    def _engine_members(self, spec) -> list:
        return [m for m in spec.members if m.role == self.engine_role]

    def _mode(self, engine: SGLangClient) -> str:
        """How this engine is paused for an update: the configured mode; "auto" = none for an engine that
        loads updates between steps while generating (the built-in engine), abort for others (SGLang)."""
        if self.pause_mode != "auto":
            return self.pause_mode
        return "none" if engine.live_weight_update() else "abort"

    def _each_engine(self, call) -> None:
        """Run call(member, client) for every engine concurrently; raise the first failure."""
        futures = [self._http.submit(call, m, self._engines[m.node_id]) for m in self._current_engines]
        for f in futures:  # bounded: an engine that stopped answering fails the sync, it does not hang it
            f.result(timeout=self.timeout_s + 5)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]] | WeightStream, version: int,
                announce: bool = True) -> SyncResult:
        """Broadcast `named` as `version` to the current group of receiver roles. announce=False sends an
        already published version again without recording it with the coordinator: only for engines
        (driven over HTTP, they do not read the coordinator's metadata), e.g. one that restarted. A
        WeightStream is taken bucket by bucket as the buckets are packed, and closed whatever happens."""
        stream = named if isinstance(named, WeightStream) else None
        try:
            return self._publish(stream.specs() if stream is not None else list(named), version, announce, stream)
        finally:
            if stream is not None:
                stream.close()

    def _publish(self, named: list, version: int, announce: bool, stream: WeightStream | None) -> SyncResult:
        result = SyncResult(version=version, ok=False)
        t0 = time.perf_counter()
        self.unresponsive.readmit()
        try:
            group_spec = self._resolved_group()
            result.group, result.world_size, result.backend = group_spec.name, group_spec.world_size, group_spec.backend
            wire = self._wire_dtype(group_spec, named)
            result.wire_dtype = str(wire).removeprefix("torch.")
            entries, sizes = plan_buckets(named, self.bucket_bytes, wire)
            result.bytes = sum(sizes)
            transfer = self._transfer_kind(group_spec)
            if not announce and any(m.role != self.engine_role for m in group_spec.members[1:]):
                raise ValueError("an unannounced publish can only go to engines")
            paused: list = []
            try:
                # engines first: one that cannot be paused fails the sync before the version is
                # announced, so no receiver starts waiting on a broadcast that will not come
                if self._current_engines:
                    self._each_engine(lambda m, e: self._mode(e) != "none" and (e.pause(self._mode(e)),
                                                                                 paused.append(e)))
                if announce:
                    self.dcs.publish_weights(self.run_id, WeightMetadata(
                        version=version, tensors=entries, bucket_bytes=sizes, publisher=self.node_id,
                        sync_group=group_spec, transfer=transfer))
                    result.announced = True
                result.seconds["metadata"] = time.perf_counter() - t0
                if transfer != "cuda_ipc" and (self._group is None or self._group.name != group_spec.name):
                    self._open_group(group_spec)
                    result.seconds["open_group"] = time.perf_counter() - t0 - result.seconds["metadata"]
                self._failed = False
                self._transfer(entries, sizes, bucket_tensors(entries, len(sizes), named, stream), result,
                               transfer, str(version))
            finally:
                for engine in paused:  # always resume generation, whatever happened
                    try:
                        engine.continue_generation()
                    except Exception as exc:
                        log.warning("could not resume an engine", extra={"engine": engine.base_url, "error": str(exc)})
            result.ok = True
            result.engines = [m.node_id for m in self._current_engines]
        except Exception as exc:
            result.refused = isinstance(exc, UnusableBackend) or (isinstance(exc, SGLangError) and exc.refused)
            result.engine_error = isinstance(exc, SGLangError) and not isinstance(exc, EngineUnreachable)
            self._failed = True
            self.unresponsive.after_failure({m.node_id: self._engines[m.node_id] for m in self._current_engines
                                             if m.node_id in self._engines})
            self._drop_group()
            result.error = f"{type(exc).__name__}: {exc}"
        result.seconds["total"] = time.perf_counter() - t0
        self._reporter.submit(self._report, result)
        if not result.ok:
            raise SyncFailed(result)
        return result

    def _resolved_group(self):
        """The sync group, with the transfer `auto` (or the asked backend) picks for its members (backend_choice.py):
        asked again, once, when the members call for another backend than the group was made with."""
        spec = self._sync_group()
        for attempt in range(2):
            self._current_engines = self._engine_members(spec)
            if self._current_engines:
                self._connect_engines(spec)
            places = [ReceiverPlace(m.role, self._engines[m.node_id].gpu(), self._engines[m.node_id].takes_cuda_ipc())
                      if m.role == self.engine_role else ReceiverPlace(m.role, m.gpu)
                      for m in spec.members if m.node_id != self.node_id]
            try:
                chosen = choose_backend(self.backend, self._trainer_gpu, places)
            except ValueError as exc:
                raise UnusableBackend(str(exc)) from exc
            if chosen == spec.backend or attempt:
                return spec
            self._group_backend = chosen
            spec = self.dcs.sync_group(self.run_id, self._group_request(self.receiver_roles))
        return spec

    def _transfer_kind(self, spec) -> str:
        """cuda_ipc for an ipc group; else engines speak SGLang's one broadcast per tensor, unless every one of
        them takes whole buckets (flat_buckets, which the other receivers always take)."""
        if spec.backend == "ipc":
            return "cuda_ipc"
        flat = all(self._engines[m.node_id].flat_bucket_update() for m in self._current_engines)
        return "flat_buckets" if flat else "per_tensor"

    def _wire_dtype(self, spec, named: list) -> torch.dtype:
        """What floating tensors travel in: the dtype every receiver serves, when they agree (precision.py);
        engines say theirs over HTTP (asked once per connection), the other receivers in their registration."""
        declared = [self._engines[m.node_id].served_dtype() if m.role == self.engine_role else m.weights_dtype
                    for m in spec.members if m.node_id != self.node_id]
        source = next((t.dtype for _, t in named if t.dtype in FLOATING), torch.float32)
        return wire_dtype(declared, source)

    def _group_request(self, receiver_roles: list[str]) -> SyncGroupRequest:
        return SyncGroupRequest(source_node=self.node_id, master_address=self.master_address,
                                master_port=free_port(self.master_address),  # used only if DCS makes a new group
                                receiver_roles=list(receiver_roles), backend=self._group_backend,
                                new_group=self._failed,
                                exclude_nodes=self.unresponsive.excluded())

    def prefetch_group(self, receiver_roles: list[str]) -> None:
        """Ask the coordinator now, on a worker thread, for the group of the next publish to `receiver_roles`
        (the trainer calls this as a step starts training), so that the publish skips that round trip on its way
        to the receivers. A publish takes the answer only if it is for the same roles, younger than
        GROUP_MAX_AGE_S and no sync failed since; otherwise it asks again, as it does without a prefetch."""
        request = self._group_request(receiver_roles)
        with self._lock:
            self._prefetched = (time.monotonic(), request,
                                self._http.submit(self.dcs.sync_group, self.run_id, request))

    def _sync_group(self):
        with self._lock:
            prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            at, request, answer = prefetched
            if (not self._failed and request.receiver_roles == list(self.receiver_roles)
                    and request.exclude_nodes == self.unresponsive.excluded()
                    and request.backend == self._group_backend
                    and time.monotonic() - at <= GROUP_MAX_AGE_S):
                try:
                    return answer.result(timeout=self.timeout_s)
                except Exception:  # asked again below, where a coordinator error is raised
                    pass
        return self.dcs.sync_group(self.run_id, self._group_request(self.receiver_roles))

    def _transfer(self, entries, sizes, tensors, result: SyncResult, transfer: str, version: str) -> None:
        """The buckets to every receiver, bracketed by /begin ... /end_weight_update for engines that need it:
        a live-update engine loads a single bucket when its call ends (two HTTP round trips fewer); SGLang
        0.5.23, and any engine receiving several buckets, get the bracket, and every begin gets its end, also
        when the transfer fails (0.5.23 refuses a second begin). An engine that says another version than the
        one it loaded (SGLang 0.5.6 records none for an update made while paused) is told the version."""
        began = time.perf_counter()
        bracket = len(sizes) > 1
        brackets = lambda e: bracket or not e.live_weight_update()  # noqa: E731
        try:
            self._each_engine(lambda m, e: brackets(e) and e.begin_weight_update())
            # measured, not derived: packing overlaps the broadcast, so wall - pack - broadcast can be negative
            result.seconds["engines"] = time.perf_counter() - began
            device = self.device if result.backend in ("nccl", "ipc") else "cpu"  # gloo reads host memory
            result.seconds.update(self._packing.send_all(
                entries, sizes, tensors, device, lambda k, bucket, flat: self._send_bucket(bucket, flat, sizes[k],
                                                                                           transfer, version)))
        except BaseException:
            self._each_engine_quietly(lambda e: brackets(e) and e.end_weight_update())
            raise
        loading = time.perf_counter()
        self._each_engine(lambda m, e: brackets(e) and e.end_weight_update())
        self._each_engine(lambda m, e: self._mode(e) != "none" and e.ensure_weight_version(version))
        result.seconds["engine_load"] = time.perf_counter() - loading

    def _each_engine_quietly(self, call) -> None:
        """call(client) for every engine, on a failed sync's way out: errors are logged, not raised."""
        try:
            self._each_engine(lambda m, e: call(e))
        except Exception as exc:
            log.warning("an engine did not take the end of a failed update", extra={"error": repr(exc)})

    def resume_engines(self) -> int:
        """Send /continue_generation to every live engine: a publisher that died between pausing the
        engines and resuming them (in its `finally`) leaves them paused. Only this run's engines (another run's
        are its own trainer's). Returns how many answered."""
        resumed = 0
        for node in self.dcs.topology().roles.get(self.engine_role, []):
            url = node.url()
            if not node.alive or url is None or node.run_id != self.run_id:
                continue
            engine = self._engine_client(url)
            try:
                engine.continue_generation()
                resumed += 1
            except Exception as exc:
                log.warning("could not resume engine", extra={"node_id": node.node_id, "error": str(exc)})
            finally:
                engine.close()
        return resumed

    def _engine_client(self, url: str) -> SGLangClient:
        """An engine's client, with the stack's one token (the coordinator's)."""
        return SGLangClient(url, timeout_s=self.timeout_s, api_key=self.dcs.token)

    def _connect_engines(self, spec) -> None:
        missing = [m for m in self._current_engines if m.node_id not in self._engines]
        if not missing:  # the usual publish: the group's engines are known (no topology round trip)
            return
        nodes = {n.node_id: n for ns in self.dcs.topology().roles.values() for n in ns}
        for m in missing:
            url = nodes[m.node_id].url()
            if url is None:
                raise RuntimeError(f"engine node {m.node_id} registered no 'http' or 'https' port")
            self._engines[m.node_id] = self._engine_client(url)

    def _open_group(self, spec) -> None:
        """Engines join through /init_weights_update_group, which blocks until everyone joined, so
        their calls run while this process joins as rank 0."""
        if self._group is not None:
            self._group.close()
        joins = [self._http.submit(self._engines[m.node_id].init_weights_update_group, spec.master_address,
                                   spec.master_port, m.rank, spec.world_size, spec.name, spec.backend,
                                   self.timeout_s) for m in self._current_engines]
        self._group = BroadcastGroup.open(spec.name, spec.backend, spec.master_address, spec.master_port, 0,
                                          spec.world_size, self.timeout_s)
        for join in joins:
            join.result(timeout=self.timeout_s)

    def _send_bucket(self, bucket, flat: torch.Tensor, size: int, transfer: str, version: str) -> None:
        if transfer == "cuda_ipc":
            self._share_bucket(bucket, flat, version)
            return
        flat_spec = {"offsets": [e.offset for e in bucket], "nbytes": size} if transfer == "flat_buckets" else None
        # the engines' HTTP calls return only after receiving: send them first, then broadcast
        calls = [self._http.submit(self._engines[m.node_id].update_weights_from_distributed,
                                   [e.name for e in bucket], [e.dtype for e in bucket],
                                   [e.shape for e in bucket], self._group.name, version,
                                   self._mode(self._engines[m.node_id]) not in ("in_place", "none"),
                                   self.timeout_s, flat_spec)
                 for m in self._current_engines]
        if transfer == "flat_buckets":
            self._group.broadcast(flat, 0)
        else:
            for e in bucket:  # typed, as the engine allocates it (NCCL matches dtype and count)
                self._group.broadcast(flat[e.offset:e.offset + e.nbytes].view(TORCH_DTYPES[e.dtype]), 0)
        for call in calls:
            call.result(timeout=self.timeout_s)

    def _share_bucket(self, bucket, flat: torch.Tensor, version: str) -> None:
        """The bucket to every engine on this GPU by CUDA IPC handle; they answer once they copied it out, so the
        staging buffer may be packed again after."""
        shared = {"shared": share(flat), "names": [e.name for e in bucket], "dtypes": [e.dtype for e in bucket],
                  "shapes": [e.shape for e in bucket], "offsets": [e.offset for e in bucket]}
        calls = [self._http.submit(self._engines[m.node_id].update_weights_from_tensor, shared, version,
                                   self._mode(self._engines[m.node_id]) not in ("in_place", "none"), self.timeout_s)
                 for m in self._current_engines]
        for call in calls:
            call.result(timeout=self.timeout_s)

    def _report(self, result: SyncResult) -> None:
        try:
            self.dcs.report_sync(self.run_id, SyncReport(version=result.version, group=result.group or "none",
                                                         node_id=self.node_id, ok=result.ok, error=result.error,
                                                         seconds=result.seconds, bytes=result.bytes))
        except Exception as exc:  # reporting must not turn a good sync into a failure
            log.warning("could not report sync: %s", exc, extra={"error": str(exc)})
