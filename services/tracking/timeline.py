"""Where a run's wall time went, from the spans every service records (services/runtime/spans.py).

`fetch_spans` reads `GET /spans` from each service; `stage_busy` says how long each service was busy over a
window (the union of its working spans, so concurrent groups in the rollout are not counted twice);
`step_table` splits each trained step's wall time (from the end of the previous step's publish to the end of
its own) into the trainer's phases and every other service's busy time in that window; `draw_lanes` draws one
lane per service, working spans coloured by name and waiting spans (claim, pause) in grey (`draw_gantt` as a PNG
of its own; `sluice report` as a panel of the run's report).

Ideal-overlap bound: with perfect overlap a step takes as long as its busiest stage, so over a run
`sum(stage busy) / max(stage busy)` is the speed-up that overlapping the stages could give over running them
one after another; a fully-async run reaches a fraction of it (`overlap_efficiency`). A stage is a service,
except that the rollout and its engines are one stage, generation (the rollout's generate spans are its wait
for the engines).
"""

from __future__ import annotations

from collections import defaultdict

import httpx

from services.runtime.tls import client_ssl_context

WAITING = {"claim", "pause"}  # spans that are waiting, not working


def fetch_spans(
    urls: dict[str, str],
    since: float = 0.0,
    timeout_s: float = 10.0,
    token: str = "",
    client: httpx.Client | None = None,
) -> dict[str, list[dict]]:
    """{lane: spans} from each service's /spans (with the stack's `token`, when it has one); a service that
    does not answer gets no lane. `client`: a caller that reads spans again and again passes its own (a new
    client builds an SSL context, ~20 ms of CPU: one per read of every service cost a training run's trainer
    a few percent of a core)."""
    if client is None:
        with span_client() as own:
            return fetch_spans(urls, since, timeout_s, token, own)
    out = {}
    headers = {"authorization": f"Bearer {token}"} if token else {}
    for lane, url in urls.items():
        try:
            r = client.get(url.rstrip("/") + "/spans", params={"since": since}, timeout=timeout_s, headers=headers)
            r.raise_for_status()
            out[lane] = r.json()["spans"]
        except (httpx.HTTPError, KeyError, ValueError):
            continue
    return out


def span_client() -> httpx.Client:
    """An HTTP client for the services' /spans, trusting what the stack's HTTPS clients trust (docs/security.md)."""
    return httpx.Client(verify=client_ssl_context())


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _clipped(spans: list[dict], start: float, end: float, names=None, working: bool = True):
    for s in spans:
        if (s["name"] in WAITING) == working or (names is not None and s["name"] not in names):
            continue
        lo, hi = max(s["start"], start), min(s["end"], end)
        if hi > lo:
            yield lo, hi


def stage_busy(spans_by_lane: dict[str, list[dict]], start: float, end: float) -> dict[str, float]:
    """Seconds each service spent working within [start, end]."""
    return {lane: union_seconds(list(_clipped(spans, start, end))) for lane, spans in spans_by_lane.items()}


def stage_of(lane: str) -> str:
    return "generation" if lane == "rollout" or lane.startswith("engine") else lane


def overlap_summary(spans_by_lane: dict[str, list[dict]], start: float, end: float) -> dict:
    lanes = stage_busy(spans_by_lane, start, end)
    stages: dict[str, list[dict]] = defaultdict(list)
    for lane, spans in spans_by_lane.items():
        stages[stage_of(lane)].extend(spans)
    busy = stage_busy(stages, start, end)
    wall = end - start
    top = max(busy.values(), default=0.0)
    bound = sum(busy.values()) / top if top > 0 else 0.0
    achieved = sum(busy.values()) / wall if wall > 0 else 0.0
    return {
        "window_s": round(wall, 3),
        "busy_s": {k: round(v, 3) for k, v in lanes.items()},
        "busy_fraction": {k: round(v / wall, 3) for k, v in lanes.items()} if wall > 0 else {},
        "stage_busy_s": {k: round(v, 3) for k, v in busy.items()},
        "ideal_overlap_bound": round(bound, 3),
        "achieved_overlap": round(achieved, 3),
        "overlap_efficiency": round(achieved / bound, 3) if bound > 0 else 0.0,
    }


def step_table(spans_by_lane: dict[str, list[dict]], trainer: str = "trainer") -> list[dict]:
    """One row per trained step: its window, the trainer's seconds by span name, other services' busy seconds."""
    publishes = sorted((s for s in spans_by_lane.get(trainer, []) if s["name"] == "publish"), key=lambda s: s["end"])
    rows, previous_end = [], None
    for pub in publishes:
        start = previous_end if previous_end is not None else _first_start(spans_by_lane[trainer], pub["step"])
        end = pub["end"]
        by_name: defaultdict[str, float] = defaultdict(float)
        for s in spans_by_lane[trainer]:
            lo, hi = max(s["start"], start), min(s["end"], end)
            if hi > lo:
                by_name[s["name"]] += hi - lo
        others = {
            lane: round(union_seconds(list(_clipped(spans, start, end))), 3)
            for lane, spans in spans_by_lane.items()
            if lane != trainer
        }
        rows.append(
            {
                "step": pub["step"],
                "start": start,
                "wall_s": round(end - start, 3),
                "trainer_s": {k: round(v, 3) for k, v in sorted(by_name.items())},
                "busy_s": others,
            }
        )
        previous_end = end
    return rows


def _first_start(spans: list[dict], step) -> float:
    return min((s["start"] for s in spans if s.get("step") == step), default=0.0)


COLOURS = {
    "generate": "tab:blue",
    "reward": "tab:cyan",
    "put": "tab:olive",
    "forward": "tab:purple",
    "advantage": "tab:pink",
    "train": "tab:red",
    "checkpoint": "tab:brown",
    "publish": "tab:orange",
    "weight_load": "tab:green",
}


def draw_lanes(ax, spans_by_lane: dict[str, list[dict]], start: float, end: float) -> None:
    """One lane per service on `ax` (a matplotlib Axes), seconds from `start` on x: working spans coloured by
    name, waiting spans grey, with a legend below."""
    import matplotlib.pyplot as plt

    lanes = list(spans_by_lane)
    for y, lane in enumerate(lanes):
        # one broken_barh per lane and colour: a call per span re-fits the axes' limits to every bar drawn so
        # far, which made a 200-step demo's report take minutes (~10,000 spans)
        bars: dict[tuple[str, float], list[tuple[float, float]]] = {}
        for s in spans_by_lane[lane]:
            lo, hi = max(s["start"], start), min(s["end"], end)
            if hi <= lo:
                continue
            waiting = s["name"] in WAITING
            style = ("lightgrey", 0.35) if waiting else (COLOURS.get(s["name"], "tab:gray"), 0.9)
            bars.setdefault(style, []).append((lo - start, hi - lo))
        for (colour, alpha), ranges in sorted(bars.items(), key=lambda kv: kv[0][1]):  # waiting under working
            ax.broken_barh(ranges, (y - 0.35, 0.7), alpha=alpha, facecolors=colour)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_xlim(0, end - start)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="lightgrey"))
    ax.legend(
        handles,
        [*COLOURS, "waiting (claim, pause)"],
        loc="upper center",
        ncol=5,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.25 if len(lanes) > 3 else -0.4),
    )


def draw_gantt(spans_by_lane: dict[str, list[dict]], path: str, start: float, end: float, title: str = "") -> None:
    """A PNG of `draw_lanes` alone (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(spans_by_lane)))
    draw_lanes(ax, spans_by_lane, start, end)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
