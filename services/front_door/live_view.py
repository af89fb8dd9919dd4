"""How a followed run is shown: a live rich panel when stdout is a terminal (step N of M with ETA, reward
and held-out eval reward, samples/s, tokens/s, staleness, weight version, each service's state and the
failure), else one JSON line per trained step and a final summary line (for logs, CI and other programs)."""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.front_door.follower import RunProgress, StepSeen

# a step's JSON line: these metrics when the trainer reported them (its record has more, see docs/services.md)
STEP_KEYS = (
    "weight_version",
    "reward_mean",
    "loss",
    "entropy",
    "kl",
    "clip_fraction",
    "grad_norm",
    "staleness_max",
    "tokens_per_s",
    "wait_s",
    "filtered_groups",
)


def _rounded(value):
    return round(value, 4) if isinstance(value, float) else value


def step_line(progress: RunProgress, seen: StepSeen) -> dict:
    line = {"step": seen.step, "num_steps": progress.num_steps, "eval_reward": _rounded(progress.eval_reward)}
    line.update({k: _rounded(seen.metrics[k]) for k in STEP_KEYS if k in seen.metrics})
    rate = progress.samples_per_s()
    line["samples_per_s"] = round(rate, 3) if rate else None
    return line


class JsonLinesView:
    """One JSON object per line: {"event": ...} notes, one per trained step, and the summary last."""

    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stdout

    def note(self, event: str, **fields) -> None:
        self._write({"event": event, **fields})

    def _write(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def step(self, progress: RunProgress, seen: StepSeen) -> None:
        self._write(step_line(progress, seen))

    def refresh(self, progress: RunProgress) -> None:
        pass

    def end(self, progress: RunProgress) -> None:
        self._write(progress.summary())


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def render(progress: RunProgress) -> Group:
    """The panel: a headline, the last step's metrics and the services table."""
    p = progress
    last = p.steps[-1].metrics if p.steps else {}
    colour = {"finished": "green", "failed": "red", "stopped": "yellow", "paused": "yellow"}.get(p.state, "cyan")
    head = Text.assemble(
        ("run ", "bold"),
        (p.run_id, "bold"),
        "  ",
        (p.state, f"bold {colour}"),
        f"  step {p.next_step}/{p.num_steps}  ETA {_duration(p.eta_s())}  elapsed {_duration(_elapsed(p))}",
    )
    metrics = Table(box=None, show_header=True, header_style="bold")
    shown = {
        "reward": last.get("reward_mean"),
        "eval reward": p.eval_reward,
        "loss": last.get("loss"),
        "samples/s": p.samples_per_s(),
        "tokens/s": last.get("tokens_per_s"),
        "staleness": last.get("staleness_max"),
        "version": p.weight_version,
    }
    if "filtered_groups" in last:  # dynamic sampling: groups of the step dropped as uninformative
        shown["filtered"] = last["filtered_groups"]
    for name in shown:
        metrics.add_column(name, justify="right")
    metrics.add_row(*(_fmt(v) for v in shown.values()))
    services = Table(title="services", title_justify="left", header_style="bold")
    for column in ("role", "rank", "state", "step", "version", "address", "last error"):
        services.add_column(column)
    errors = _last_errors(p)
    for s in p.status.services if p.status else []:  # every engine of the run is one: added, joined or left
        error = errors.get(s.node_id) or errors.get(s.role) or ""
        services.add_row(s.role, str(s.rank), s.state, _fmt(s.step), _fmt(s.weight_version), s.url or "", error[-80:])
    parts: list[RenderableType] = [head, metrics, services]
    if p.failure:
        parts.append(Text(f"failure: {p.failure}", style="bold red"))
    return Group(*parts)


def _last_errors(progress: RunProgress) -> dict[str, str]:
    """node id and role -> the newest failure the coordinator holds for it (the first, then later ones)."""
    status = progress.status
    if status is None or status.failure is None:
        return {}
    errors = {}
    for failure in [status.failure, *status.later_failures]:
        errors[failure.role] = failure.message
        if failure.node_id:
            errors[failure.node_id] = failure.message
    return errors


def _elapsed(progress: RunProgress) -> float:
    return time.monotonic() - progress.started_at


class RichLiveView:
    """A panel redrawn in place while the run goes on; the final state stays on screen."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.live: Live | None = None

    def note(self, event: str, **fields) -> None:
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        self.console.print(f"[bold]{event}[/bold] {text}")

    def step(self, progress: RunProgress, seen: StepSeen) -> None:
        pass  # the panel shows the newest step on refresh

    def refresh(self, progress: RunProgress) -> None:
        if self.live is None:
            self.live = Live(render(progress), console=self.console, refresh_per_second=4)
            self.live.start()
        else:
            self.live.update(render(progress))

    def end(self, progress: RunProgress) -> None:
        self.refresh(progress)
        assert self.live is not None  # refresh just started it if it was not running
        self.live.stop()
        self.live = None


def choose_view(mode: str = "auto") -> JsonLinesView | RichLiveView:
    """`auto`: the live panel on a terminal, JSON lines otherwise."""
    if mode == "live" or (mode == "auto" and sys.stdout.isatty()):
        return RichLiveView()
    return JsonLinesView()
