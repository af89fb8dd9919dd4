"""Built-in verifiable tasks, the `demo:<task>` prompt sources: rows generated from their index (no files,
no downloads), each with the reward spec that scores it.

    reverse   "Reverse: d a c b" -> "b c a d" (3-5 letters). Exact-match reward, binary. A random model
              scores 0; `sluice demo` warm-starts it for a few seconds (services/demo_tasks/warm_start.py)
              and RL then takes the held-out score from ~0.2 to over 0.8. It teaches the whole loop: a
              verifiable answer, group-relative advantages, a held-out curve that moves.
    arith     "What is 12 + 7?" -> "19" (math_answer reward). Too hard for a model of a few million
              parameters without much pre-training: a task for your own model.
    letters   "Write a short word using only the letters ..." (fraction of allowed letters, continuous).
              Even a random model's samples differ in reward, so GRPO always has a signal: the
              throughput benchmarks use it; it does not teach anything useful.
    tool      "What is 512 + 347? Use the add tool ..." played by an agent (services/demo_tasks/tool_agent.py)
              that runs the model's `add` calls and sends the results back; the last reply is scored as
              arith scores it. Multi-turn, tool-using rollouts end to end; a random model rarely calls the
              tool, so it shows the machinery, not learning.

Training reads rows 0 .. DEMO_LENGTH-1 (position % DEMO_LENGTH); held-out evaluation reads rows from
DEMO_LENGTH on, which training never reaches."""

from __future__ import annotations

from typing import Callable, NamedTuple

from services.demo_tasks import catalog
from services.demo_tasks.catalog import DEMO_LENGTH


class DemoTask(NamedTuple):
    generate: Callable[[int], tuple[str, dict]]  # row index -> (prompt, fields)
    reward: str  # the default reward spec (built-in reward name)
    summary: str  # one line for `sluice demo --task`
    label_field: str = "label"
    agent: str | None = None  # the agent that plays its episodes (rollout.agent), if any
    # the demo's rollout.filter_groups: dynamic sampling where it was measured to help (docs/algorithms.md); a
    # task the policy comes to solve outright would have nearly every group dropped and fail at max_filter_ratio
    filter_groups: str = "none"


DEMO_TASKS: dict[str, DemoTask] = {
    "reverse": DemoTask(
        catalog.reverse_row,
        "exact_match",
        "reverse 3-5 letters; exact match; learnable in minutes after a short warm start",
        filter_groups="zero_variance",
    ),
    "arith": DemoTask(catalog.arith_row, "arith", "add two numbers below 100; math answer"),
    "letters": DemoTask(
        catalog.letters_row, "letters", "a word from given letters; continuous reward; for throughput benchmarks"
    ),
    "tool": DemoTask(
        catalog.tool_row,
        "arith",
        "add two 3-digit numbers with an add tool (an agent, docs/agents.md)",
        agent="import:services.demo_tasks.tool_agent:solve",
    ),
}


def held_out_row(task: DemoTask, index: int) -> tuple[str, dict]:
    """Row `index` of the task's held-out set (never a training row)."""
    return task.generate(DEMO_LENGTH + index)
