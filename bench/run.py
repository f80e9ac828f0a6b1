"""`make bench`: the same closed-loop load against five scenarios, on this machine, in one run.

    python bench/run.py [--quick] [--duration 6] [--warmup 1.5] [--out bench/results]

Scenarios (servers.SCENARIOS): the executor called in-process at max_batch_size, kserve_ascend
without and with dynamic batching, real Triton with the `ascend` backend, and a stock KServe
custom model. Every server serves all three models on free loopback ports and is stopped
before the next starts. Loads (PROTOCOLS), closed loop at concurrency 1, 10, 64:
- `http`: JSON over HTTP with hey, for sim and simple;
- `binary` and `grpc`: binary tensors over HTTP and raw tensors over gRPC with perf_analyzer
  (Triton's load generator, pa_load.py), for all three, on every server but stock KServe,
  which lacks the model configuration perf_analyzer needs;
- `grpc-py`: raw tensors over gRPC with tritonclient's asyncio client (grpc_load.py), on stock
  KServe and, to compare with it under the same load generator, kserve_ascend with batching.
One line per point is printed as it finishes; report.py writes results.md, qps_p99.png and
results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hey_load
import pa_load
import report
import servers
from cpu import CpuMeter, wait_for_quiet
from payloads import json_body

BENCH = Path(__file__).resolve().parent
MODELS = ("sim", "simple", "yolov8n")
#: JSON of a [1,3,640,640] image is 1.2 M numbers in text: that model goes in binary only.
PROTOCOLS = {"sim": ("http", "binary", "grpc", "grpc-py"), "simple": ("http", "binary", "grpc", "grpc-py"), "yolov8n": ("binary", "grpc", "grpc-py")}
#: The loads perf_analyzer generates.
PERF_ANALYZER_PROTOCOLS = frozenset({"binary", "grpc"})


def protocols(model: str, scenario: str) -> list[str]:
    """The loads of a model on a scenario's server."""
    if scenario == "stock":  # no model configuration extension: perf_analyzer cannot drive it
        return [p for p in PROTOCOLS[model] if p not in PERF_ANALYZER_PROTOCOLS]
    # grpc-py is stock KServe's gRPC load: run on kserve_ascend with batching to compare under the same generator.
    return [p for p in PROTOCOLS[model] if p != "grpc-py" or scenario == "batch"]


def python_json(script: str, *args) -> dict:
    """Runs a bench script in its own process (fresh interpreter, own GIL) and reads its JSON line."""
    done = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{script} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.points: list[dict] = []
        served = [s for s in servers.SCENARIOS if s != "raw"]
        self.total = 2 * len(MODELS) + sum(len(protocols(m, s)) for m in MODELS for s in served) * len(args.concurrency)
        for model in MODELS:
            (workdir / f"{model}.json").write_bytes(json_body(model))

    def record(self, point: dict) -> None:
        self.points.append(point)
        rss = f"  rss {point['rss_start_mb']:.0f}->{point['rss_end_mb']:.0f} MiB" if "rss_start_mb" in point else ""
        errors = f"  ERRORS {point['errors']} {point.get('first_error', '')[:80]}" if point["errors"] else ""
        p50 = "-" if point["p50_ms"] is None else f"{point['p50_ms']:.1f}"
        p99 = "-" if point["p99_ms"] is None else f"{point['p99_ms']:.1f}"
        cpu = f"  cores srv/load/other {point['server_cores']:.2f}/{point['load_cores']:.2f}/{point['other_cores']:.2f}"
        if point["waited_s"] > 2:
            cpu += f" (waited {point['waited_s']:.0f} s for a quiet machine)"
        print(
            f"[{len(self.points):2d}/{self.total}] {point['model']:8s}{point['scenario']:8s}{point['protocol']:8s}"
            f"c={point['concurrency']:<3}{point['qps']:9.1f} /s  p50 {p50:>7} ms  p99 {p99:>7} ms{cpu}{rss}{errors}",
            flush=True,
        )

    def raw(self) -> None:
        # At max_batch_size (the ceiling the targets use) and, to show what batching buys the executor, at 1.
        for model in MODELS:
            for batch in (0, 1):
                args = ("--model", model, "--batch", batch, "--duration", self.args.duration, "--warmup", self.args.warmup)
                point = self.measure(lambda: python_json("raw.py", *args))
                self.record({"model": model, "scenario": "raw", "protocol": "call", "concurrency": point["batch"], **point})

    def server(self, scenario: str) -> None:
        with servers.running(scenario, self.workdir, self.args.out / "logs") as server:
            for model in MODELS:
                for protocol in protocols(model, scenario):
                    for concurrency in self.args.concurrency:
                        point = self.measure(lambda: self.load(server, model, protocol, concurrency), server)
                        self.record({"model": model, "scenario": scenario, "protocol": protocol, "concurrency": concurrency, **point})

    def measure(self, run, server=None) -> dict:
        """One point, started on a quiet machine: its figures, where the cores went, and the server's memory."""
        waited = 0.0 if self.args.quick else wait_for_quiet()
        rss_start = servers.rss_mb(server) if server else None
        with CpuMeter(server.process.pid if server else None) as meter:
            point = run()
        point.update(meter.cores(), waited_s=waited)
        if server:
            point.update(
                rss_start_mb=rss_start,
                rss_end_mb=servers.rss_mb(server),
                # Warm-up and window carry the same load, so mean cores ÷ QPS is CPU per request.
                server_cpu_ms=point["server_cores"] * 1000 / point["qps"] if point["qps"] else None,
            )
        return point

    def load(self, server, model: str, protocol: str, concurrency: int) -> dict:
        a = self.args
        if protocol == "http":
            url = f"{server.url}/v2/models/{model}/infer"
            return hey_load.load(url, self.workdir / f"{model}.json", concurrency, a.duration, a.warmup)
        if protocol in PERF_ANALYZER_PROTOCOLS:
            return pa_load.load(server, model, protocol, concurrency, a.duration, a.warmup, self.workdir)
        return python_json(
            "grpc_load.py", "--url", server.grpc, "--model", model, "--concurrency", concurrency,
            "--duration", a.duration, "--warmup", a.warmup,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 s per point, concurrency 1 and 10: checks the bench runs")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of the same load before each point")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (bench/results/quick with --quick)")
    args = parser.parse_args()
    args.concurrency = (1, 10, 64)
    if args.quick:
        args.duration, args.warmup, args.concurrency = 1.0, 0.5, (1, 10)
    args.out = (args.out or BENCH / "results" / ("quick" if args.quick else "")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    # The tree may hold uncommitted work: say which code was measured.
    code = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=BENCH).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kserve-ascend-bench-") as tmp:
        bench = Bench(args, Path(tmp))
        servers.make_repositories(bench.workdir)
        print(f"{bench.total} points, {args.duration:g} s each after {args.warmup:g} s of warm-up; logs in {args.out / 'logs'}", flush=True)
        for scenario in servers.SCENARIOS:
            print(f"--- {servers.SCENARIOS[scenario]}", flush=True)
            bench.raw() if scenario == "raw" else bench.server(scenario)
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": time.monotonic() - started,
        "machine": _machine(),
        "code": code,
        "duration_s": args.duration, "warmup_s": args.warmup, "concurrency": list(args.concurrency),
        "scenarios": servers.SCENARIOS,
        "simple_batching": servers.SIMPLE_DYNAMIC_BATCHING.strip(),
        "points": bench.points,
    }
    report.write(run, args.out)
    print(f"done in {run['seconds']:.0f} s: {args.out / 'results.md'}, {args.out / 'qps_p99.png'}, {args.out / 'results.json'}")


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.machine())
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
