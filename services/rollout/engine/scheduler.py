"""The built-in engine's continuous-batching loop, on its own thread.

Every step runs one ragged forward over all running sequences: newly admitted ones contribute their
whole pending input (prefill), the others their last token (decode). Requests that arrive while
others decode join at the next step; finished sequences leave at once. Control operations (pause
modes, weight loads, cache flushes) run on this thread between steps, so they never race a forward.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.model.ragged_decoder import KVCache, RaggedDecoder
from services.rollout.engine.sampling import SamplingParams, sample

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_update: Callable[["Sequence"], None]
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs_num: int = 0
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    logprob_start_len: int = -1            # >= 0: report prompt log-probs from this position
    input_logprobs: list[float | None] | None = None
    spans: list[dict] = field(default_factory=list)
    cache: KVCache | None = None
    finish_reason: dict | None = None
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending(self) -> list[int]:
        """Tokens not yet in the cache: the whole prompt + output after (re)admission, else the last."""
        known = self.cache.length if self.cache else 0
        return (self.prompt + self.output)[known:]

    def note_version(self, version: str) -> None:
        index = len(self.output) - 1
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = index + 1
        else:
            self.spans.append({"version": version, "start": index, "end": index + 1})


class Scheduler:
    def __init__(self, decoder: RaggedDecoder, tokenizer, max_running: int = 64, max_step_tokens: int = 4096):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.weight_version = "default"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.frozen: list[Sequence] = []      # in_place pause: kept with their caches
        self.paused = False
        self._cv = threading.Condition()
        self._controls: deque = deque()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(10)

    # ------------------------------------------------------------ called from other threads

    def submit(self, seq: Sequence) -> None:
        with self._cv:
            self.waiting.append(seq)
            self._cv.notify_all()

    def control(self, fn: Callable[[], object]) -> "threading.Event":
        """Run fn on the engine thread between steps; returns an event set when done (result/error on it)."""
        done = threading.Event()
        done.result = None
        done.error = None
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
                while not self._stop and not self._controls and (self.paused or not (self.waiting or self.running)):
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
            if not self.paused:
                self._step()

    def _admit(self) -> list[Sequence]:
        budget = self.max_step_tokens - len(self.running)
        admitted = []
        with self._cv:
            while self.waiting and len(self.running) + len(admitted) < self.max_running:
                seq = self.waiting[0]
                need = len(seq.prompt) + len(seq.output)
                if admitted and need > budget:
                    break
                self.waiting.popleft()
                if seq.finished:  # aborted while waiting
                    continue
                seq.cache = KVCache()
                budget -= need
                admitted.append(seq)
        return admitted

    def _step(self) -> None:
        self.running.extend(self._admit())
        self.running = [s for s in self.running if not s.finished]
        if not self.running:
            return
        batch = self.running
        # prompt log-probs need every position's logits, once, on the sequence's first prefill
        wants_prompt = [s.logprob_start_len >= 0 and s.input_logprobs is None for s in batch]
        logits = self.decoder.forward([torch.tensor(s.pending(), dtype=torch.long) for s in batch],
                                      [s.cache for s in batch], all_logits=any(wants_prompt))
        if any(wants_prompt):
            for seq, rows, wanted in zip(batch, logits, wants_prompt):
                if wanted:
                    self._prompt_logprobs(seq, rows)
            logits = [rows[-1] for rows in logits]
        for seq, row in zip(batch, logits):
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
                continue
            banned = list(self.eos_ids) if len(seq.output) < seq.params.min_new_tokens else []
            token, logprobs = sample(row, seq.params, seq.generator, banned)
            seq.output.append(token)
            seq.logprobs.append(float(logprobs[token]))
            if seq.top_logprobs_num:
                top = torch.topk(logprobs, seq.top_logprobs_num)
                seq.top_logprobs.append(list(zip(top.values.tolist(), top.indices.tolist())))
            seq.note_version(self.weight_version)
            self._check_finished(seq, token)
            seq.on_update(seq)
        self.running = [s for s in self.running if not s.finished]

    @staticmethod
    def _prompt_logprobs(seq: Sequence, rows: torch.Tensor) -> None:
        """log p(prompt[i] | prompt[:i]) for i >= logprob_start_len; the first token has none."""
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        out: list[float | None] = []
        for i in range(seq.logprob_start_len, len(seq.prompt)):
            out.append(None if i == 0 else float(logprobs[i - 1, seq.prompt[i]]))
        seq.input_logprobs = out

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        stops = p.stop_strings()
        if stops:  # decoding every step costs O(n) per token: only when stop strings need it
            seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        if len(seq.output) >= p.min_new_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return self._finish(seq, {"type": "stop", "matched": token})
            if p.stop_token_ids and token in p.stop_token_ids:
                return self._finish(seq, {"type": "stop", "matched": token})
            for stop in stops:
                at = seq.text.find(stop)
                if stop and at >= 0:
                    seq.text = seq.text[:at]
                    return self._finish(seq, {"type": "stop", "matched": stop})
        if len(seq.output) >= p.max_new_tokens:
            self._finish(seq, {"type": "length", "length": p.max_new_tokens})

    def _finish(self, seq: Sequence, reason: dict) -> None:
        if not isinstance(reason.get("matched"), str):  # a stop string already cut the text
            seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        seq.finish_reason = reason
        seq.cache = None
        seq.on_update(seq)

    # ------------------------------------------------------------ controls (engine thread)

    def abort(self, prefix: str | None) -> int:
        """Abort requests whose rid starts with prefix (None = all), with their partial output."""
        count = 0
        with self._cv:
            pool = list(self.waiting) + self.running + self.frozen
        for seq in pool:
            if not seq.finished and (prefix is None or seq.rid.startswith(prefix)):
                self._finish(seq, {"type": "abort", "message": "aborted"})
                count += 1
        self.running = [s for s in self.running if not s.finished]
        self.frozen = [s for s in self.frozen if not s.finished]
        return count

    def pause(self, mode: str) -> None:
        self.paused = True
        if mode == "abort":
            self.abort(None)
        elif mode == "in_place":
            self.frozen.extend(self.running)
            self.running = []
        elif mode == "retract":  # keep generated tokens, drop KV: recomputed under the new weights
            with self._cv:
                for seq in reversed(self.running):
                    seq.cache = None
                    self.waiting.appendleft(seq)
            self.running = []
        else:
            raise ValueError(f"unknown pause mode {mode!r}")

    def resume(self) -> None:
        self.running = self.frozen + self.running
        self.frozen = []
        self.paused = False


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{int(time.time() * 1000)}-{next(_rid_counter)}"
