"""Stack start: from `sluice run run.yaml` to the first generated group, phase by phase and service by service;
prints one JSON object to stdout (progress goes to stderr) and writes it, with every start's details, to --out.

Each start runs the run of `sluice run --print-defaults` (every default: GRPO on demo:letters, 32 groups of 8
samples a step, 64 new tokens, one built-in engine) on one `sluice init-model --preset tiny` model made
beforehand, so no start writes a model, with `num_steps: --steps`, a free coordinator port and its own output
directory (the run file names only these), as a user would: `python -m services.cli run run.yaml --view json`, timed from the moment it is started (t0).
Every time below is seconds after t0, the median over --reps starts:

  first_group_s     the rollout's first group written to TransferQueue (the end of its first `put` span, from
                    the run's spans.json): the target of issue #36 (<= 10 s)
  first_step_s      the trainer's first step finished (its `step finished` log line)
  front_door_s      `sluice run` printed `starting`: its own imports, the run file and the preflight checks
  running_s         `sluice run` printed `running`: every service started and the run submitted
  stack_cpu_s       CPU seconds `sluice run` and every process it started used until the first group;
  machine_busy_cpu_s  CPU seconds the whole machine was busy meanwhile (the difference went to other work;
                    the machine has `cpus` cores: first_group_s * cpus seconds in all)
  services          per service: `started` (its process began), `imported` (its entry point ran: interpreter
                    and imports; `import_s` and `import_cpu_s` are that interval's wall and CPU seconds),
                    `ready` (it serves: the coordinator's and the roles' HTTP servers up, the TransferQueue's
                    gRPC servers serving, the engine's HTTP server up, Redis accepting connections) and, for a
                    role, `running` (the run read, its set-up done: the rollout about to generate)

The services' own log lines carry the times (every service logs JSON lines with `ts`; `service starting` is
written by services/runtime/startup.py). The machine's load average is reported before and after, since on a
small machine the services' start-up shares its cores with whatever else runs.

With --baseline-tree DIR (another version's services/, e.g. the commit before a change: `git archive COMMIT
services | tar -x -C DIR`), that version's starts alternate with this tree's on the same machine and model, and
its medians are reported beside (`baseline`; the services' own start lines are there only where that version
writes them).

Usage: python benchmarks/stack_start.py [--reps 5] [--steps 1] [--baseline-tree DIR] [--out DIR]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import yaml  # noqa: E402

_T0 = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tree: its services/ are measured
# a service's JSON log line that says it serves
READY = {
    "dcs": "Uvicorn running on",
    "tq-controller": "controller serving",
    "tq-shard": "shard serving",
    "engine": "Uvicorn running on",
    "rollout": "Uvicorn running on",
    "trainer": "Uvicorn running on",
    "advantage": "Uvicorn running on",
    "forward": "Uvicorn running on",
}


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def write_run_file(directory: str, model: str, steps: int) -> str:
    """`sluice run --print-defaults`'s run, written as the keys it changes only (so that a --baseline-tree of
    another version, which may lack some of this version's keys, reads the same run)."""
    run = {
        "name": "stack-start",
        "model": model,
        "num_steps": steps,
        "stack": {"coordinator_port": 0, "output_dir": os.path.join(directory, "runs")},
    }
    path = os.path.join(directory, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(run, f, sort_keys=False)
    return path


class CpuSampler(threading.Thread):
    """Every 0.1 s: the CPU seconds `sluice run` and its children have used so far, and the whole machine's
    busy CPU seconds, so that how much of the machine a start had (and how much went to other work) can be
    read off at any moment of it."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.halt = pid, [], threading.Event()
        self.used: dict[int, float] = {}  # pid -> its CPU seconds when last seen (an exited one keeps them)
        self.names: dict[int, str] = {}  # pid -> `sluice run`, or the command it runs (engine, rollout, ...)
        self.by_name: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.halt.wait(0.1):
            for pid in [self.pid, *children_of(self.pid)]:
                if (fields := stat_fields(pid)) is not None:
                    self.used[pid] = (int(fields[11]) + int(fields[12])) / tick
                    # asked again each time: a child just forked still shows its parent's command line
                    self.names[pid] = "sluice run" if pid == self.pid else command_of(pid)
            per_name: dict[str, float] = {}
            for pid, used in self.used.items():
                per_name[self.names[pid]] = per_name.get(self.names[pid], 0.0) + used
            self.by_name.append((time.time(), per_name))
            with open("/proc/stat", encoding="ascii") as f:
                cpu = [int(x) for x in f.readline().split()[1:]]
            self.samples.append((time.time(), sum(self.used.values()), (sum(cpu) - cpu[3] - cpu[4]) / tick))

    def at(self, t: float) -> tuple[float, float] | None:
        """(CPU seconds of the stack, busy CPU seconds of the machine) since the first sample, at time t."""
        before = [s for s in self.samples if s[0] <= t]
        if not before:
            return None
        return before[-1][1] - self.samples[0][1], before[-1][2] - self.samples[0][2]

    def by_service_at(self, t: float) -> dict[str, float]:
        """CPU seconds each process (by command) had used at time t."""
        before = [per_name for when, per_name in self.by_name if when <= t]
        return {name: round(used, 2) for name, used in before[-1].items()} if before else {}


def command_of(pid: int) -> str:
    """The sluice command a process runs (`python -m services.cli engine ...` -> engine), else its program."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # a forked service's is one string (setproctitle)
            argv = " ".join(f.read().decode(errors="replace").split("\0")).split()
    except OSError:
        return "?"
    if not argv:  # a zombie's, or one exiting: no command line left
        return "?"
    if "services.runtime.fork_server" in argv:
        return "fork server"
    return argv[argv.index("services.cli") + 1] if "services.cli" in argv[:-1] else os.path.basename(argv[0])


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(parent: int) -> list[int]:
    """Every descendant of `parent`: its children, and theirs (the services a fork server forked)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
    found, frontier = [], {parent}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        found.extend(frontier)
    return found


def start_once(
    directory: str, model: str, steps: int, timeout_s: float, tree: str
) -> tuple[float, dict[str, float], CpuSampler]:
    """Run `sluice run` (of source tree `tree`) to its end -> (t0, when each of its stdout events arrived, its
    CPU samples)."""
    path = write_run_file(directory, model, steps)
    events: dict[str, float] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", path, "--view", "json"],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    sampler = CpuSampler(proc.pid)
    sampler.start()
    try:
        for line in proc.stdout:
            event = json.loads(line).get("event") if line.startswith("{") else None
            if event is not None:
                events.setdefault(event, time.time())
        proc.wait(timeout=timeout_s)
    finally:
        sampler.halt.set()
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"sluice run exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    return t0, events, sampler


def json_lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def redis_ready(log_dir: str) -> float | None:
    """Redis's `Ready to accept connections` (its log's clock is local time, to the millisecond)."""
    for path in glob.glob(os.path.join(log_dir, "redis-*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if "Ready to accept connections" in line:
                    stamp = " ".join(line.split()[1:5])  # 4220:M 28 Nov 2026 03:33:22.493 * Ready ...
                    whole, millis = stamp.rsplit(".", 1)
                    parsed = time.strptime(whole, "%d %b %Y %H:%M:%S")
                    return time.mktime(parsed) + int(millis) / 1000
    return None


def service_times(lines: list[dict], t0: float) -> dict[str, float]:
    """One service's start-up, from its log lines, in seconds after t0."""
    out: dict[str, float] = {}
    for entry in lines:
        msg, ts = entry.get("msg", ""), entry.get("ts")
        if msg == "service starting" and "started" not in out:
            if "started_at" in entry:
                out.update(started=entry["started_at"] - t0, import_s=entry["import_s"])
            out.update(imported=ts - t0, import_cpu_s=entry["import_cpu_s"])
        elif msg.startswith(READY.get(entry.get("service", ""), "\0")) and "ready" not in out:
            out["ready"] = ts - t0
        elif msg == "role running" and "running" not in out:
            out["running"] = ts - t0
    return out


def read_start(run_dir: str, t0: float, events: dict[str, float]) -> dict:
    """Every time of one start, in seconds after t0."""
    log_dir = os.path.join(run_dir, "logs")
    services: dict[str, dict[str, float]] = {}
    first_step = None
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
        name = os.path.basename(path)[:-4]
        if name.startswith("redis-"):
            continue
        lines = json_lines(path)
        services[name] = service_times(lines, t0)
        if name == "trainer":
            first_step = next((e["ts"] - t0 for e in lines if e.get("msg") == "step finished"), None)
    if (ready := redis_ready(log_dir)) is not None:
        services["redis"] = {"ready": ready - t0}
    with open(os.path.join(run_dir, "spans.json"), encoding="utf-8") as f:
        rollout = json.load(f)["rollout"]
    puts = [s["end"] for s in rollout if s["name"] == "put"]
    generates = [s["start"] for s in rollout if s["name"] == "generate"]
    return {
        "first_group_s": min(puts) - t0,
        "first_generate_s": min(generates) - t0,
        "first_step_s": first_step,
        "front_door_s": events.get("starting", t0) - t0,
        "running_s": events.get("running", t0) - t0,
        "services": services,
    }


def median_of(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(starts: list[dict]) -> dict:
    phases = (
        "first_group_s",
        "first_generate_s",
        "first_step_s",
        "front_door_s",
        "running_s",
        "stack_cpu_s",
        "machine_busy_cpu_s",
    )
    result = {k: median_of([s[k] for s in starts]) for k in phases}
    result["first_group_all_s"] = [round(s["first_group_s"], 3) for s in starts]
    names = sorted({name for s in starts for name in s["services"]})
    keys = ("started", "import_s", "import_cpu_s", "imported", "ready", "running")
    processes = sorted({name for s in starts for name in s.get("cpu_s_by_process", {})})
    result["cpu_s_by_process"] = {
        name: median_of([s.get("cpu_s_by_process", {}).get(name) for s in starts]) for name in processes
    }
    result["services"] = {
        name: {k: m for k in keys if (m := median_of([s["services"].get(name, {}).get(k) for s in starts])) is not None}
        for name in names
    }
    return result


def measure(tree: str, work: str, model: str, rep: int, args) -> dict:
    """One start of `sluice run` with the services of source tree `tree` (first on PYTHONPATH)."""
    directory = os.path.join(work, f"start-{rep}-{os.path.basename(tree)}")
    os.makedirs(directory)
    t0, events, sampler = start_once(directory, model, args.steps, args.timeout_s, tree)
    start = read_start(os.path.join(directory, "runs", "stack-start"), t0, events)
    if (cpu := sampler.at(t0 + start["first_group_s"])) is not None:
        start.update(
            stack_cpu_s=cpu[0],
            machine_busy_cpu_s=cpu[1],
            cpu_s_by_process=sampler.by_service_at(t0 + start["first_group_s"]),
        )
    log(f"start {rep} ({tree}): first group at {start['first_group_s']:.2f} s, load {os.getloadavg()[0]:.2f}")
    return start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="starts; every time reported is their median")
    p.add_argument("--steps", type=int, default=1, help="num_steps of the run (each start runs it to its end)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest one start may take, run included")
    p.add_argument(
        "--baseline-tree",
        default=None,
        help="a directory holding another version's services/ (e.g. `git archive COMMIT services | tar "
        "-x -C DIR`): its starts alternate with this tree's, and both are reported",
    )
    p.add_argument("--out", default=None, help="directory for stack_start.json (default: a temp dir)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sluice-stack-start-")
    out = args.out or work
    os.makedirs(out, exist_ok=True)
    model = os.path.join(work, "model")
    subprocess.run(
        [sys.executable, "-m", "services.cli", "init-model", model, "--preset", "tiny"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    trees = [ROOT] + ([os.path.abspath(args.baseline_tree)] if args.baseline_tree else [])
    load_before = os.getloadavg()
    starts: dict[str, list[dict]] = {tree: [] for tree in trees}
    for rep in range(args.reps):
        for tree in trees if rep % 2 == 0 else trees[::-1]:  # alternated: both see the machine alike
            starts[tree].append(measure(tree, work, model, rep, args))
    result = {"benchmark": "stack_start", **summarize(starts[ROOT])}
    if args.baseline_tree:
        baseline = summarize(starts[trees[1]])
        result.update(
            baseline=baseline, first_group_vs_baseline=round(result["first_group_s"] / baseline["first_group_s"], 3)
        )
    result.update(
        load_avg_before=[round(x, 2) for x in load_before],
        load_avg_after=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(),
        config=vars(args),
    )
    with open(os.path.join(out, "stack_start.json"), "w") as f:
        json.dump({**result, "starts": starts}, f, indent=1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
