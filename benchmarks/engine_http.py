"""The built-in engine as benchmarks/engine_throughput.py measures it: `sluice engine` started in its own
process, one round of the workload sent to it over HTTP (every request at once), its counters and CPU."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp

from services.runtime.processes import ChildProcess, free_port, http_ok, sluice_argv


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_engine(model_dir: str, log_dir: str, *extra: str) -> tuple[ChildProcess, str]:
    port = free_port()
    proc = ChildProcess(
        "engine",
        sluice_argv(
            "engine", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra
        ),
        os.path.join(log_dir, f"engine-{port}.log"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 120)
    return proc, url


async def _engine_round(url: str, workload: list[dict]) -> tuple[float, list[float], list[list[int]]]:
    # aiohttp, not httpx: 64 concurrent posts cost httpx's connection pool ~1.4 s of client CPU on this
    # machine (aiohttp: 0.02 s), so an httpx client measured itself rather than the engine
    connector = aiohttp.TCPConnector(limit=len(workload) + 4)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:

        async def one(req: dict) -> tuple[float, list[int]]:
            body = {
                "input_ids": req["prompt"],
                "sampling_params": {"max_new_tokens": req["max_new_tokens"], "temperature": 0, "ignore_eos": True},
            }
            start = time.perf_counter()
            async with client.post("/generate", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"engine answered {r.status}: {(await r.text())[:500]}")
                out = await r.json()
            seconds = time.perf_counter() - start
            if out["meta_info"]["completion_tokens"] != req["max_new_tokens"]:
                raise RuntimeError(
                    f"engine generated {out['meta_info']['completion_tokens']} tokens, asked {req['max_new_tokens']}"
                )
            return seconds, out["output_ids"]

        async def health() -> None:
            async with client.get("/health") as r:
                await r.read()

        # open the connections first, so connection setup is not inside the timing
        await asyncio.gather(*(health() for _ in workload))
        # every round repeats the workload: its drafts must not come from an earlier round's outputs
        async with client.post("/flush_cache") as r:
            if r.status != 200:
                raise RuntimeError(f"/flush_cache answered {r.status}: {(await r.text())[:500]}")
        start = time.perf_counter()
        results = await asyncio.gather(*(one(req) for req in workload))
        wall = time.perf_counter() - start
    return wall, [s for s, _ in results], [ids for _, ids in results]


def engine_counters(url: str) -> dict:
    """The engine's step and speculation counters (its /metrics) over every round, warm-up included."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("sluice_engine_") and " " in line
    }
    drafted = values.get("sluice_engine_draft_tokens", 0.0)
    accepted = values.get("sluice_engine_accepted_draft_tokens", 0.0)
    return {
        "steps": int(values.get("sluice_engine_steps", 0)),
        "draft_tokens": int(drafted),
        "accepted_draft_tokens": int(accepted),
        "acceptance": round(accepted / drafted, 3) if drafted else None,
    }


def engine_round(url: str, pid: int, workload: list[dict]) -> dict:
    cpu0 = proc_cpu_seconds(pid)
    wall, latencies, outputs = asyncio.run(_engine_round(url, workload))
    return {"wall_s": wall, "latencies_s": latencies, "outputs": outputs, "engine_cpu_s": proc_cpu_seconds(pid) - cpu0}
