"""Part (a) of benchmarks/gpu_check.py: the whole run of deploy/one_gpu.yaml under `sluice run`, measured from
outside (its JSON lines, the run dir's steps.jsonl and the GPU's utilisation through NVML), and the child
processes every part runs (a time budget each, the process group killed past it)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import yaml

from services.runtime.processes import Reaper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_FILE = os.path.join(ROOT, "deploy", "one_gpu.yaml")
GRACE_S = 8.0  # past its budget a child gets SIGINT (sluice run: pause, stop every service), then SIGKILL


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- child processes


def child_env() -> dict[str, str]:
    """This environment, the checkout first on PYTHONPATH (`python -m services.cli` from anywhere)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def child_name(argv: list[str]) -> str:
    """`sluice run`, `pytest`, `engine_throughput.py`: what a python child runs."""
    if argv[1:3] == ["-m", "services.cli"]:
        return f"sluice {argv[3]}"
    return argv[2] if argv[1] == "-m" else os.path.basename(argv[1])


def run_child(argv: list[str], budget_s: float, log_path: str, on_line=None) -> dict:
    """Run argv in the checkout, its own process group (registered with this process's reaper, so it dies
    with us: services/runtime/reaper.py), stderr to log_path; each stdout line kept with the time.time() it
    arrived (and passed to on_line). Past budget_s: SIGINT, then after GRACE_S SIGKILL to its group.
    Returns rc, timed_out, seconds, lines [(epoch, text)], exited_at (epoch)."""
    lines: list[tuple[float, str]] = []
    start = time.time()
    reaper = Reaper.get()
    with open(log_path, "w") as err:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        reaper.register(proc.pid)

        def read() -> None:
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                if on_line is not None:
                    on_line(lines[-1])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            log(f"{child_name(argv)}: past its {budget_s:.0f} s budget, stopping it")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        exited_at = time.time()
        reaper.forget(proc.pid)
        reader.join(timeout=5)
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(exited_at - start, 2),
        "lines": lines,
        "exited_at": exited_at,
    }


def stderr_tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------- GPU utilisation


class GpuSampler:
    """The GPU's utilisation (percent of the last sample period with a kernel running) and memory in use,
    every period_s, through NVML (pynvml), else `nvidia-smi -lms`: samples of (epoch, percent, MiB)."""

    def __init__(self, index: int = 0, period_s: float = 0.25):
        self.index, self.period_s = index, period_s
        self.samples: list[tuple[float, float, float]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi: subprocess.Popen | None = None

    def start(self) -> "GpuSampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            self.source, target = "nvml", lambda: self._nvml(pynvml, handle)
        except Exception:  # no pynvml (or no driver for it): nvidia-smi, where there is one
            try:
                self._smi = subprocess.Popen(
                    [
                        "nvidia-smi",
                        "--query-gpu=utilization.gpu,memory.used",
                        "--format=csv,noheader,nounits",
                        "-lms",
                        str(int(self.period_s * 1000)),
                        "-i",
                        str(self.index),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            except OSError:
                return self
            self.source, target = "nvidia-smi", self._read_smi
        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()
        return self

    def _nvml(self, pynvml, handle) -> None:
        while not self._stop.wait(self.period_s):
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            self.samples.append((time.time(), float(util), float(used)))

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            try:
                util, used = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), util, used))

    def stop(self) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def busy(self, t0: float | None, t1: float | None) -> dict:
        """Mean utilisation (a fraction) of the samples taken in [t0, t1]."""
        window = [s for s in self.samples if t0 is not None and t1 is not None and t0 <= s[0] <= t1]
        if not window:
            return {"busy_fraction": None, "samples": 0}
        return {
            "busy_fraction": round(sum(s[1] for s in window) / len(window) / 100, 3),
            "samples": len(window),
            "memory_used_max_mib": round(max(s[2] for s in window)),
        }


def gpu_index() -> int:
    """NVML's index of the GPU this process's CUDA device 0 is (CUDA_VISIBLE_DEVICES' first, if a number)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


# ---------------------------------------------------------------------------------- the run


def write_run_file(work: str, model_dir: str, device: str, steps: int | None) -> tuple[str, dict]:
    """deploy/one_gpu.yaml with its model, run dir and coordinator port of this check; on a CPU (the smoke)
    the engine and trainer on the CPU, float32 engine, tiny batches. Returns (path, the run file's data)."""
    with open(RUN_FILE) as f:
        data = yaml.safe_load(f)
    stack = data.setdefault("stack", {})
    data.update(name="gpu-check", model=model_dir)
    stack.update(output_dir=os.path.join(work, "runs"), coordinator_port=0)
    if device == "cpu":
        data.update(
            num_steps=3,
            n_samples_per_prompt=4,
            rollout_batch_size=4,
            global_batch_size=16,
            micro_batch_size=8,
            tracking={"report_to": []},
        )
        data["rollout"]["max_new_tokens"] = 16
        stack["engine_flags"].update(device="cpu", dtype="float32")
        stack["role_flags"].setdefault("trainer", {})["device"] = "cpu"
    if steps:
        data["num_steps"] = steps
    path = os.path.join(work, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path, data


def read_steps(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _share(steps: list[dict]) -> float | None:
    wait = sum(s.get("wait_s", 0.0) for s in steps)
    busy = wait + sum(s.get("compute_s", 0.0) for s in steps)
    return round(wait / busy, 3) if busy > 0 else None


def step_figures(steps: list[dict]) -> dict:
    """From steps.jsonl. Step 0's step_s runs from the trainer's start, so the rates and fractions are over
    the later steps: samples/s = their samples / (last step's time - first's); wait fraction = their
    sum(wait_s) / sum(step_s); publish seconds per step and as a fraction of a step."""
    later = steps[1:]
    span = steps[-1]["wall_time"] - steps[0]["wall_time"] if len(steps) > 1 else 0.0
    step_s = sum(s.get("step_s", 0.0) for s in later)
    publish = [round(s.get("publish_s", 0.0), 3) for s in steps]
    out = {
        "samples_per_s": round(sum(s.get("samples", 0) for s in later) / span, 2) if span > 0 else None,
        "trained_tokens_per_s": round(sum(s.get("tokens", 0) for s in later) / span, 1) if span > 0 else None,
        "wait_fraction": round(sum(s.get("wait_s", 0.0) for s in later) / step_s, 3) if step_s > 0 else None,
        "wait_fraction_all_steps": round(
            sum(s.get("wait_s", 0.0) for s in steps) / max(1e-9, sum(s.get("step_s", 0.0) for s in steps)), 3
        ),
        "step_s_mean": _mean([s.get("step_s", 0.0) for s in later]),
        "wait_s_mean": _mean([s.get("wait_s", 0.0) for s in later]),
        "compute_s_mean": _mean([s.get("compute_s", 0.0) for s in later]),
        "wait_share_of_wait_and_compute": _share(later),
        "publish_s": publish,
        "publish_s_mean": _mean(publish[1:] or publish),
        "staleness_max": max((s.get("staleness_max", 0) for s in steps), default=None),
    }
    if out["publish_s_mean"] is not None and out["step_s_mean"]:
        out["publish_fraction"] = round(out["publish_s_mean"] / out["step_s_mean"], 3)
    return out


def events(lines: list[tuple[float, str]]) -> dict[str, tuple[float, dict]]:
    """The `sluice run --view json` lines that are events (running, finished, failed, ...), by event name."""
    found = {}
    for at, text in lines:
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" in record:
            found[record["event"]] = (at, record)
    return found


def make_model(work: str, preset: str, budget_s: float) -> str:
    model_dir = os.path.join(work, "model")
    child = run_child(
        [sys.executable, "-m", "services.cli", "init-model", model_dir, "--preset", preset],
        budget_s,
        os.path.join(work, "init-model.log"),
    )
    if child["rc"] != 0:
        raise RuntimeError(f"sluice init-model failed: {stderr_tail(os.path.join(work, 'init-model.log'))}")
    return model_dir


def run_one_gpu(device: str, budget_s: float, steps: int | None = None) -> dict:
    """The whole run of deploy/one_gpu.yaml (on a CPU: the smoke's tiny version) and its figures."""
    started = time.time()
    work = tempfile.mkdtemp(prefix="sluice-gpu-check-run-")
    model_dir = make_model(work, "medium" if device != "cpu" else "tiny", min(120.0, budget_s))
    path, data = write_run_file(work, model_dir, device, steps)
    sampler = GpuSampler(gpu_index()).start() if device != "cpu" else None
    log(f"sluice run {path} ({data['num_steps']} steps; logs in {work})")
    launched = time.time()
    child = run_child(
        [sys.executable, "-m", "services.cli", "run", path, "--view", "json"],
        budget_s - (launched - started),
        os.path.join(work, "sluice-run.stderr"),
    )
    if sampler is not None:
        sampler.stop()
    steps_seen = read_steps(os.path.join(work, "runs", data["name"], "steps.jsonl"))
    seen = events(child["lines"])
    end_at, end = next((seen[e] for e in ("finished", "failed", "stopped") if e in seen), (None, {}))
    out = {
        "status": "ok" if child["rc"] == 0 and len(steps_seen) == data["num_steps"] else "failed",
        "steps_finished": len(steps_seen),
        "num_steps": data["num_steps"],
        "rc": child["rc"],
        "timed_out": child["timed_out"],
        "budget_s": round(budget_s),
        "model_s": round(launched - started, 1),
        "end_event": end.get("event"),
        "failure": end.get("failure"),
        "samples_per_s_sluice_run": end.get("samples_per_s"),
        "services_up_s": round(seen["running"][0] - launched, 2) if "running" in seen else None,
        "startup_s": round(steps_seen[0]["wall_time"] - launched, 2) if steps_seen else None,
        "exit_s": round(child["exited_at"] - end_at, 2) if end_at is not None else None,
        "sluice_run_s": child["seconds"],
        "run_file": {
            k: data[k] for k in ("max_staleness", "n_samples_per_prompt", "rollout_batch_size", "micro_batch_size")
        },
        "engine_flags": data["stack"]["engine_flags"],
        "trainer_flags": data["stack"]["role_flags"].get("trainer"),
    }
    out["run_file"]["max_new_tokens"] = data["rollout"]["max_new_tokens"]
    if steps_seen:
        out.update(step_figures(steps_seen))
    if sampler is not None:
        first, last = (steps_seen[0]["wall_time"], steps_seen[-1]["wall_time"]) if steps_seen else (None, None)
        out["gpu"] = {
            "source": sampler.source,
            "first_to_last_step": sampler.busy(first, last),
            "launch_to_end": sampler.busy(launched, end_at or child["exited_at"]),
        }
    if out["status"] != "ok":
        out["stderr_tail"] = stderr_tail(os.path.join(work, "sluice-run.stderr"))
        out["service_log_tails"] = service_log_tails(os.path.join(work, "runs", data["name"], "logs"))
    for bulky in (model_dir, os.path.join(work, "runs", data["name"], "checkpoints")):
        shutil.rmtree(bulky, ignore_errors=True)  # the model and the checkpoint on stop: GBs at the medium preset
    out["logs"] = work
    return out


def service_log_tails(directory: str, chars: int = 800) -> dict[str, str]:
    """The end of every service's log of a run that went wrong (where its error is)."""
    return {
        os.path.basename(path): stderr_tail(path, chars) for path in sorted(glob.glob(os.path.join(directory, "*.log")))
    }
