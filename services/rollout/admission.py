"""Staleness-bounded admission of prompt groups (AReaL, Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning", section 5.2).

Group g (0-based, in prompt order) belongs to step N = g // G (G = rollout_batch_size). The trainer
trains step N with weight version V(N) = N + offset (offset = 0 unless a resumed trainer renumbered).
A sample whose generation begins under version s must be trained at a version <= s + max_staleness, so
group g may start under engine version v only if

    N + offset <= v + max_staleness
    <=>  g < (max_staleness + v - offset + 1) * G

i.e. capacity = (max_staleness + current_version + 1) x G - (groups accepted + in flight), counted
from the start of the run. max_staleness = 0 is on-policy: step N is generated only under version N.
The seeds' partition rule `N + 1 - oldest_unconsumed_step <= max_staleness` is the special case of
admitting whole partitions at a time.

The offset is the trainer's recorded version - next_step, except while a renumbered version is on the
engines before the step that published it is recorded (a failed sync the coordinator had recorded is
retried under the next number): the trainer records step N only after publishing its version, and
publishes the next step's only after that record, so engines serve at most progress.version + 1 unless
renumbered, and

    offset = max(recorded version - next_step, v - next_step - 1)

is exact in that window too (admitting under the recorded offset alone would start one step too many)."""

from __future__ import annotations


def admission_limit(max_staleness: int, engine_version: int, version_offset: int, groups_per_step: int) -> int:
    """The number of groups (counted from group 0) that may have begun generating."""
    return max(0, (max_staleness + engine_version - version_offset + 1) * groups_per_step)


def version_offset(recorded_version: int, next_step: int, engine_version: int) -> int:
    """The offset the trainer trains its next steps at, from its recorded progress and the engines' version."""
    return max(recorded_version - next_step, engine_version - next_step - 1)


def may_admit(
    position: int, max_staleness: int, engine_version: int, version_offset: int, groups_per_step: int
) -> bool:
    return position < admission_limit(max_staleness, engine_version, version_offset, groups_per_step)


def parse_version(text: str | int | None) -> int:
    """Engines report versions as strings; one that never received weights says "default" (= 0)."""
    if text is None:
        return 0
    try:
        return int(text)
    except (TypeError, ValueError):
        return 0
