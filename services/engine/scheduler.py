"""The built-in engine's continuous-batching loop, on its own thread.

Every step is one batched forward (services/engine/batched_decoder.py) over every running request: decoding
ones contribute their last token, newly admitted ones a chunk of their prompt (at most `chunked_prefill_size`
prefill tokens a step, shared out in admission order), and then one batched sampling call picks a token for
every request whose input is complete. Requests that arrive while others decode join at the next step;
finished ones leave at once and free their KV slot. When every slot is taken new requests wait; nothing is
dropped. The n samples of one prompt are admitted together: the first prefills the prompt, the others get a
copy of its KV and sample from the same last-position logits. Controls (pause modes, aborts, weight loads,
memory release) run on this thread between steps, so they never race a forward pass.

A step that raises is not retried: every request held fails with the error, `failure` says why, `on_fatal`
tells the server (503, then exit non-zero for its supervisor to restart it) and the thread ends: a loop going
on could serve from a corrupt KV pool, one silently dead would leave every caller waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

import torch

from services.engine.kv_pool import KVPool
from services.engine.request import Generation, still_waiting
from services.engine.greedy_drafting import GreedyDrafting
from services.engine.sampling import sample_batch
from services.engine.speculation import NgramDrafter
from services.runtime.spans import RECORDER

log = logging.getLogger(__name__)


class StepForward(Protocol):
    """A step's forward: `BatchedDecoder`, or it split over CPU threads (parallel_forward.py)."""

    pool: KVPool

    def forward(
        self, slots: list[int], new_tokens: list[list[int]], full_logits: list[bool] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...


class ControlDone(threading.Event):
    """Set when a control (Scheduler.control) ran on the engine thread; what it returned, or what it raised."""

    result: object = None
    error: Exception | None = None


class Scheduler:
    def __init__(
        self,
        decoder: StepForward,
        tokenizer,
        chunked_prefill_size: int = 4096,
        num_draft_tokens: int = 0,
        draft_budget: int = 64,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        """num_draft_tokens > 0: n-gram speculative decoding of greedy requests (greedy_drafting.py), at most that
        many drafts per request and `draft_budget` per step. `on_fatal(error)`: called when a step failed."""
        self.decoder, self.pool = decoder, decoder.pool
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.chunked_prefill_size = chunked_prefill_size
        self.weight_version = "default"
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.frozen: list[Generation] = []  # in_place pause: kept with their KV slots
        self.paused, self._paused_at = False, 0.0
        self.released: set[str] = set()  # memory tags released (memory_occupation.py): no step runs
        self.steps = 0
        self.speculation = GreedyDrafting(num_draft_tokens, draft_budget)
        self._cv = threading.Condition()
        self._controls: deque[tuple[Callable[[], object], ControlDone]] = deque()
        self._stop = False
        self.failure: str | None = None  # why the loop stopped on an error (None: healthy)
        self.on_fatal = on_fatal
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(10)

    # ------------------------------------------------------------ called from other threads

    def submit(self, group: list[Generation]) -> None:
        """One request, or the n samples of one prompt (the leader first). After a fatal error they fail
        at once."""
        with self._cv:
            if self.failure is None:
                self.waiting.append(group[0])
                self._cv.notify_all()
                return
        for req in group:
            self._finish(req, {"type": "abort", "message": f"engine error: {self.failure}"})

    def queued(self) -> int:
        """Samples waiting for a KV slot (a waiting leader brings its siblings)."""
        with self._cv:
            return sum(1 + len(r.followers) for r in self.waiting)

    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def control(self, fn: Callable[[], object]) -> ControlDone:
        """Run fn on the engine thread between steps; returns an event set when done (result/error on it)."""
        done = ControlDone()
        with self._cv:
            self._controls.append((fn, done))
            self._cv.notify_all()
        return done

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.frozen)

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._controls) and (
                    self.paused or self.released or not (self.waiting or self.running)
                ):
                    self._cv.wait()
                if self._stop:
                    return
                controls = list(self._controls)
                self._controls.clear()
            for fn, done in controls:
                try:
                    done.result = fn()
                except Exception as exc:  # reported to the caller
                    done.error = exc
                done.set()
            if not (self.paused or self.released):
                try:
                    began = time.time()
                    self.step()
                    # back-to-back steps are one busy interval on the timeline
                    RECORDER.merge("generate", began, time.time(), gap_s=0.005, version=self.weight_version)
                except Exception as exc:  # never leave callers waiting on a dead loop
                    self._fail(exc)
                    return

    def _fail(self, exc: Exception) -> None:
        """A step raised: fail every request the engine holds with the error and stop (see the module doc)."""
        log.exception("engine step failed: failing every request and stopping the engine")
        with self._cv:
            self.failure = f"{type(exc).__name__}: {exc}"
            held = self._held()
            self.waiting.clear()
        for req in held:
            if not req.finished:
                self._finish(req, {"type": "abort", "message": f"engine error: {self.failure}"})
        self.running, self.frozen = [], []
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _held(self) -> list:
        """Every request the engine holds: queued (with a queued leader's followers), running, frozen.
        Called under the lock."""
        return list(self.waiting) + [f for r in self.waiting for f in r.followers] + self.running + self.frozen

    def _admit(self) -> None:
        """Waiting requests into free slots, in arrival order; a leader brings as many siblings as fit."""
        with self._cv:
            while self.waiting and self.pool.free_slots:
                req = self.waiting.popleft()
                if not req.finished and len(req.tokens) >= self.pool.slot_len:
                    self._finish(req, {"type": "length", "length": len(req.output)})
                if req.finished:  # aborted while waiting
                    self._requeue_followers(req)
                    continue
                followers = [f for f in req.followers if not f.finished]
                fit = min(len(followers), self.pool.free_slots - 1)
                for late in reversed(followers[fit:]):  # no room now: each will prefill on its own
                    late.leader = None
                    self.waiting.appendleft(late)
                req.followers = followers[:fit]
                for r in [req, *req.followers]:
                    r.slot = self.pool.allocate()
                    r.cached = 0
                    self.running.append(r)

    def step(self) -> None:
        """One forward over every running request, then one batched sample for those whose input is done."""
        self._admit()
        batch, chunks = self._plan()
        if not batch:
            return
        self.steps += 1
        wants_prompt = [r.logprob_start_len >= 0 and r.input_logprobs is None for r in batch]
        logits, full = self.decoder.forward(
            [r.kv_slot() for r in batch], chunks, [w or bool(r.draft) for w, r in zip(wants_prompt, batch)]
        )
        samplers: list[Generation] = []
        rows: list[int] = []
        verifying = [i for i, req in enumerate(batch) if req.draft]
        if verifying:
            self._verify([batch[i] for i in verifying], [full[i] for i in verifying])
        for i, (req, chunk) in enumerate(zip(batch, chunks)):
            if verifying and i in full and not wants_prompt[i]:
                continue  # a verified draft: took its tokens above
            req.cached += len(chunk)
            if i in full:
                req.set_prompt_logprobs(full[i])
            if req.pending():
                continue  # a prefill chunk: more of the prompt to go
            for r in self._share_prefix(req):
                samplers.append(r)
                rows.append(i)
        if samplers:
            self._sample(samplers, logits[rows] if rows != list(range(len(batch))) else logits)
        self.running = [r for r in self.running if not r.finished]
        self._compact()

    def _compact(self) -> None:
        """Fill the slots finished requests left with the highest-slot running ones and keep `running` in slot
        order: decode batches then read consecutive slots, a view of the pool rather than a gather (which,
        in a long tail of a few long sequences, copied as many bytes per step as the weights)."""
        for req in sorted(self.running, key=lambda r: -r.kv_slot()):
            req.slot = self.pool.move_down(req.kv_slot())
        self.running.sort(key=Generation.kv_slot)

    def _plan(self) -> tuple[list[Generation], list[list[int]]]:
        """Which requests run this step and with which tokens: every decode, then prefill chunks in
        admission order up to the prefill budget. A request wanting prompt log-probs prefills whole."""
        batch: list[Generation] = []
        chunks: list[list[int]] = []
        drafting: list[tuple[int, NgramDrafter]] = []  # (the request's row in the batch, its drafter)
        budget = self.chunked_prefill_size
        for req in self.running:
            pending = req.pending()
            if req.finished or req.awaiting_prefix or not pending:
                continue
            drafter = self.speculation.drafter(req) if len(pending) == 1 else None
            if drafter is not None:
                drafting.append((len(batch), drafter))
            if len(pending) > 1:
                if budget <= 0 or (req.logprob_start_len >= 0 and len(pending) > budget and batch):
                    continue
                if req.logprob_start_len < 0:
                    pending = pending[:budget]
                budget -= len(pending)
            batch.append(req)
            chunks.append(pending)
        if drafting:
            self.speculation.draft([(batch[i], drafter) for i, drafter in drafting], self.pool.slot_len)
            for i, _ in drafting:
                chunks[i] = chunks[i] + batch[i].draft
        return batch, chunks

    def _verify(self, reqs: list[Generation], logits: list[torch.Tensor]) -> None:
        """Each request takes its accepted drafts and the bonus token (GreedyDrafting.accept) one by one, as
        plain decoding would have, stopping at a finish; the KV cache keeps what was accepted."""
        for req, (tokens, logprobs) in zip(reqs, self.speculation.accept(reqs, logits)):
            start = req.cached
            for token, logprob in zip(tokens, logprobs):
                req.output.append(token)
                req.logprobs.append(logprob)
                req.note_version(self.weight_version)
                self._check_finished(req, token)
                if req.finished:
                    break  # _finish freed the slot and told the caller
            else:
                req.cached = start + len(tokens)  # the input's last token and the accepted drafts
                self.pool.lengths[req.kv_slot()] = req.cached
                req.on_update(req)

    def _share_prefix(self, req: Generation) -> list[Generation]:
        """A leader that has just prefilled its prompt hands its KV to its siblings; all sample next."""
        out = [req]
        followers = [f for f in req.followers if not f.finished and f.slot is not None]
        if followers:
            self.pool.copy_prefix(req.kv_slot(), [f.kv_slot() for f in followers], req.cached)
            for f in followers:
                f.cached, f.cached_tokens, f.leader = req.cached, req.cached, None
                f.input_logprobs = req.input_logprobs if f.logprob_start_len >= 0 else None
            out += followers
        req.followers = []
        return out

    def _sample(self, reqs: list[Generation], logits: torch.Tensor) -> None:
        banned = [list(self.eos_ids) if len(r.output) < r.params.min_new_tokens else [] for r in reqs]
        tokens, chosen, logprobs = sample_batch(logits, [r.params for r in reqs], [r.generator for r in reqs], banned)
        for k, (req, token) in enumerate(zip(reqs, tokens)):
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.output.append(token)
            req.logprobs.append(chosen[k])
            if req.top_logprobs_num:
                top = torch.topk(logprobs[k], req.top_logprobs_num)
                req.top_logprobs.append(list(zip(top.values.tolist(), top.indices.tolist())))
            req.note_version(self.weight_version)
            self._check_finished(req, token)
            req.on_update(req)

    def _check_finished(self, req: Generation, token: int) -> None:
        reason = req.stop_reason(
            token, self.eos_ids, self.pool.slot_len, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        )
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Generation, reason: dict) -> None:
        if not isinstance(reason.get("matched"), str):  # a stop string already cut the text
            req.text = self.tokenizer.decode(req.output, skip_special_tokens=True)
        req.finish_reason = reason
        self._free(req)
        req.on_update(req)

    def _free(self, req: Generation) -> None:
        if req.slot is not None:
            self.pool.release(req.slot)
        req.slot, req.cached = None, 0

    def _requeue_followers(self, leader: Generation) -> None:
        """Siblings of a leader that left before sharing its prompt go back to the queue on their own."""
        moved = [f for f in leader.followers if not f.finished]
        for f in reversed(moved):
            f.leader = None
            self._free(f)
            self.waiting.appendleft(f)
        leader.followers = []
        self.running = [r for r in self.running if r not in moved]
        self.frozen = [r for r in self.frozen if r not in moved]

    # ------------------------------------------------------------ controls (engine thread)

    def abort(self, prefix: str | None) -> int:
        """Abort requests whose rid starts with prefix (None = all), with their partial output."""
        count = 0
        with self._cv:
            pool = self._held()
        for req in pool:
            if not req.finished and (prefix is None or req.rid.startswith(prefix)):
                self._finish(req, {"type": "abort", "message": "aborted"})
                count += 1
        for req in self.running + self.frozen:
            if req.finished and req.followers:
                self._requeue_followers(req)
        self.running = [r for r in self.running if not r.finished]
        self.frozen = [r for r in self.frozen if not r.finished]
        with self._cv:  # aborted requests leave the queue at once (a paused engine's must not fill up with them)
            self.waiting = deque(r for queued in self.waiting for r in still_waiting(queued))
        return count

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"unknown pause mode {mode!r}")
        if not self.paused:
            self._paused_at = time.time()
        self.paused = True
        if mode == "abort":
            self.abort(None)
        elif mode == "in_place":
            self.frozen.extend(self.running)
            self.running = []
        else:  # retract: keep generated tokens, drop KV; recomputed under the new weights on continue
            with self._cv:
                for req in reversed(self.running):
                    self._free(req)
                    if not req.awaiting_prefix:  # siblings waiting for a prefix go back with their leader
                        self.waiting.appendleft(req)
            self.running = []

    def resume(self) -> None:
        self.running, self.frozen = self.frozen + self.running, []
        if self.paused:
            RECORDER.record("pause", self._paused_at, time.time(), version=self.weight_version)
        self.paused = False
