"""`make bench`: the same closed-loop loads against every server, on this machine, in one run.

    python bench/run.py [--quick] [--duration 6] [--warmup 1.5] [--workers 1 2] [--out bench/results]
                        [--scenarios batch workers2 ...] [--models simple fastsim ...]

Scenarios (servers.SCENARIOS): the executor called in-process, kserve-ascend without
batching, with dynamic batching at `--workers 1` and at `--workers 2`, real Triton with the
`ascend` backend, MLServer with custom runtimes, and a stock KServe custom model. One server
runs at a time, on free loopback ports. Loads (LOADS, per scenario and model), closed loop:
- `http`: JSON over HTTP with hey;
- `binary` and `grpc`: binary tensors over HTTP and raw tensors over gRPC with perf_analyzer
  (Triton's load generator, pa_load.py), on kserve-ascend and Triton: MLServer and stock
  KServe lack the model configuration extension perf_analyzer needs;
- `grpc-py`: raw tensors over gRPC with tritonclient's asyncio client (grpc_load.py), the gRPC
  load every server takes, so that all of them compare under one generator.
Per point: requests/s, latency, and the server's CPU milliseconds per request: the CPU time of
its process tree over the requests it answered in the same span (warm-up included; counted by
the client, or by the server's statistics for perf_analyzer). A py-spy profile of kserve-ascend
(profiles.py) is taken at the PROFILED points, and the detection chain measured (detect.py).
report.py writes results.md, results.json, qps_p99.png and side_by_side.png. Then the fleet on demand
(fleet.py: 30 models of 100 MB in a 1000 MB budget, its cold-start wait, warm latency and hit rate,
fleet.md) and, with yolov8n, the detection chain (detect.py, detect.md).
`--quick` (1 s per point, one concurrency per model) writes to bench/results/quick/.
"""

from __future__ import annotations

import argparse
import contextlib
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
import profiles
import report
import servers
from cpu import CpuMeter, wait_for_quiet
from payloads import json_body

BENCH = Path(__file__).resolve().parent
MODELS = ("sim", "simple", "fastsim", "yolov8n")
#: Concurrent clients per model: sim's targets are at 10 (the CANN design's measurement), simple's and
#: fastsim's at 16 and 64 (issue 17); --quick runs the one its targets need.
CONCURRENCY = {"sim": (1, 10, 64), "simple": (16, 64), "fastsim": (16, 64), "yolov8n": (1, 10, 64)}
QUICK_CONCURRENCY = {"sim": (10,), "simple": (16,), "fastsim": (64,), "yolov8n": (1,)}
ALL = ("http", "binary", "grpc", "grpc-py")
#: The loads of each scenario, per model. JSON of a [1,3,640,640] image is 1.2 M numbers in text:
#: yolov8n goes in binary only. MLServer serves no yolov8n (its peer would be onnxruntime again).
LOADS = {
    "raw": {model: ("call",) for model in MODELS},
    "nobatch": {"sim": ("http", "grpc")},  # the denominator of sim's batching target
    "batch": {"sim": ("http", "grpc"), "simple": ALL, "fastsim": ALL, "yolov8n": ("grpc", "grpc-py")},
    "workers2": {"sim": ("http", "grpc"), "simple": ("http", "grpc", "grpc-py"), "fastsim": ("http", "grpc", "grpc-py")},
    "triton": {"sim": ("http", "grpc"), "simple": ALL, "fastsim": ALL, "yolov8n": ("grpc",)},
    "mlserver": {"sim": ("http", "grpc-py"), "simple": ("http", "grpc-py"), "fastsim": ("http", "grpc-py")},
    "stock": {"sim": ("http", "grpc-py"), "simple": ("http", "grpc-py"), "fastsim": ("http", "grpc-py"), "yolov8n": ("grpc-py",)},
}
#: The loads perf_analyzer generates; the server's statistics count what it answered.
PERF_ANALYZER_PROTOCOLS = frozenset({"binary", "grpc"})
#: Where kserve-ascend is profiled with py-spy, (scenario, model, protocol, concurrency): every point a target
#: measures (so the report links the profile that explains a miss), and simple at c=16 with --workers.
PROFILED = {t["at"] for t in report.targets([]) if t["at"]} | {
    (scenario, "simple", protocol, 16) for scenario in servers.WORKERS for protocol in ("http", "grpc")
}


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
        self.skipped: dict[str, str] = {}
        self.profiles: list[dict] = []
        self.scenarios = [s for s in servers.SCENARIOS if s not in servers.WORKERS or servers.WORKERS[s] in args.workers]
        if 1 not in args.workers:
            self.scenarios.remove("batch")
        if args.scenarios:
            self.scenarios = [s for s in self.scenarios if s in args.scenarios]
        self.total = sum(len(self.plan(s)) for s in self.scenarios)
        for model in MODELS:
            (workdir / f"{model}.json").write_bytes(json_body(model))

    def plan(self, scenario: str) -> list[tuple[str, str, int]]:
        """(model, protocol, concurrency) of each point of a scenario, in order; raw's concurrency is its batch."""
        if scenario == "raw":
            return [(model, "call", batch) for model in self.args.models for batch in (0, 1)]
        return [
            (m, p, c) for m, loads in LOADS[scenario].items() if m in self.args.models for p in loads for c in self.args.concurrency[m]
        ]

    def record(self, point: dict) -> None:
        self.points.append(point)
        rss = f"  rss {point['rss_start_mb']:.0f}->{point['rss_end_mb']:.0f} MiB" if "rss_start_mb" in point else ""
        errors = f"  ERRORS {point['errors']} {point.get('first_error', '')[:80]}" if point["errors"] else ""
        p99 = "-" if point["p99_ms"] is None else f"{point['p99_ms']:.1f}"
        cpu = "" if point.get("server_cpu_ms") is None else f"  cpu {point['server_cpu_ms']:.3f} ms/req"
        cpu += f"  cores srv/load/other {point['server_cores']:.2f}/{point['load_cores']:.2f}/{point['other_cores']:.2f}"
        if point["waited_s"] > 2:
            cpu += f" (waited {point['waited_s']:.0f} s for a quiet machine)"
        print(
            f"[{len(self.points):3d}/{self.total}] {point['model']:8s}{point['scenario']:9s}{point['protocol']:8s}"
            f"c={point['concurrency']:<3}{point['qps']:9.1f} /s  p99 {p99:>7} ms{cpu}{rss}{errors}",
            flush=True,
        )

    def raw(self) -> None:
        # At max_batch_size (the ceiling the targets use) and, to show what batching buys the executor, at 1.
        for model, _, batch in self.plan("raw"):
            args = ("--model", model, "--batch", batch, "--duration", self.args.duration, "--warmup", self.args.warmup)
            point = self.measure(lambda: python_json("raw.py", *args))
            self.record({"model": model, "scenario": "raw", "protocol": "call", "concurrency": point["batch"], **point})

    def server(self, scenario: str) -> None:
        with contextlib.ExitStack() as stack:
            try:
                server = stack.enter_context(servers.running(scenario, self.workdir, self.args.out / "logs"))
            except RuntimeError as error:
                if scenario not in servers.WORKERS:
                    raise
                # The server refused the flag or failed to start with it: the other scenarios go on.
                reason = str(error).strip().splitlines()[-1][:300]
                self.skipped[scenario] = reason
                print(f"SKIPPED {scenario} ({servers.SCENARIOS[scenario]}): the server did not start: {reason}", flush=True)
                self.total -= len(self.plan(scenario))
                return
            for model, protocol, concurrency in self.plan(scenario):
                counted = model if scenario in servers.WITH_STATISTICS else None
                server_counts = protocol in PERF_ANALYZER_PROTOCOLS  # perf_analyzer counts its windows only, the CPU is the whole run's
                point = self.measure(lambda: self.load(server, model, protocol, concurrency), server, counted, server_counts)
                self.record({"model": model, "scenario": scenario, "protocol": protocol, "concurrency": concurrency, **point})
                if (scenario, model, protocol, concurrency) in PROFILED:
                    self.profile(server, scenario, model, protocol, concurrency)

    def profile(self, server, scenario: str, model: str, protocol: str, concurrency: int) -> None:
        why_not = profiles.available()
        name = f"profile-{scenario}-{model}-{protocol}-c{concurrency}"
        if why_not:
            print(f"no profile {name}: {why_not}", flush=True)
            return
        seconds = 1 if self.args.quick else self.args.profile_seconds
        long_enough = 4 * seconds + 60  # outlives the recordings; stopped once they are done
        if protocol == "http":
            load = hey_load.command(f"{server.url}/v2/models/{model}/infer", self.workdir / f"{model}.json", concurrency, long_enough)
        else:
            load = pa_load.command(server, model, protocol, concurrency, long_enough, self.workdir / "profile.csv")
        title = (f"py-spy: {servers.SCENARIOS[scenario]}, {model}, {report.PROTOCOL_NAMES[protocol]}, c={concurrency};"
                 f" three recordings of {seconds:g} s under the same load: the flame graph's and this summary's two views")
        try:
            figures = profiles.record(server.process.pid, load, self.args.out / name, title, seconds)
        except RuntimeError as error:  # a profile is worth less than the run it is part of
            print(f"no profile {name}: {error}", flush=True)
            return
        self.profiles.append({"scenario": scenario, "model": model, "protocol": protocol, "concurrency": concurrency,
                              "svg": f"{name}.svg", "txt": f"{name}.txt", **figures})
        print(f"profile: {self.args.out / name}.svg, .txt", flush=True)

    def measure(self, run, server=None, model=None, server_counts=False) -> dict:
        """One point, started on a quiet machine: its figures, where the cores went, the server's CPU
        per request answered, and the server's memory. With `model` (a server with the statistics
        extension) also its batches: rows per execution and the share of the point its instances
        executed (`device_busy`: what a batching target's miss is made of); `server_counts`: the
        requests answered are the server's count, not the client's."""
        waited = 0.0 if self.args.quick else wait_for_quiet()
        rss_start = servers.rss_mb(server) if server else None
        before = servers.counters(server, model) if model else None
        started = time.monotonic_ns()
        with CpuMeter(server.process.pid if server else None) as meter:
            point = run()
        elapsed_ns = time.monotonic_ns() - started
        point.update(meter.cores(), waited_s=waited)
        if before is not None:
            counted = {key: value - before[key] for key, value in servers.counters(server, model).items()}
            if server_counts:
                point["answered"] = counted["answered"]
            if counted["executions"]:
                point.update(mean_batch=counted["rows"] / counted["executions"], device_busy=counted["device_ns"] / elapsed_ns)
        if server:
            answered = point.get("answered")
            point.update(
                rss_start_mb=rss_start,
                rss_end_mb=servers.rss_mb(server),
                server_cpu_ms=point["server_cpu_s"] * 1000 / answered if answered else None,
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
    parser.add_argument("--quick", action="store_true", help="1 s per point, one concurrency per model: checks the bench runs")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of the same load before each point")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], choices=[1, *servers.WORKERS.values()],
                        help="kserve-ascend's --workers counts to measure (default: 1 2)")
    parser.add_argument("--scenarios", nargs="+", choices=list(servers.SCENARIOS), help="only these scenarios (default: all)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="only these models (default: all)")
    parser.add_argument("--profile-seconds", type=float, default=4.0, help="length of each py-spy recording")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (bench/results/quick with --quick)")
    args = parser.parse_args()
    args.concurrency = CONCURRENCY
    if args.quick:
        args.duration, args.warmup, args.concurrency = 1.0, 0.5, QUICK_CONCURRENCY
    args.out = (args.out or BENCH / "results" / ("quick" if args.quick else "")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    # The tree may hold uncommitted work: say which code was measured.
    code = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=BENCH).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kserve-ascend-bench-") as tmp:
        bench = Bench(args, Path(tmp))
        servers.make_repositories(bench.workdir)
        print(f"{bench.total} points, {args.duration:g} s each after {args.warmup:g} s of warm-up; logs in {args.out / 'logs'}", flush=True)
        for scenario in bench.scenarios:
            print(f"--- {servers.SCENARIOS[scenario]}", flush=True)
            bench.raw() if scenario == "raw" else bench.server(scenario)
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": time.monotonic() - started,
        "machine": _machine(),
        "code": code,
        "quick": args.quick,
        "duration_s": args.duration, "warmup_s": args.warmup, "concurrency": args.concurrency,
        "scenarios": {s: servers.SCENARIOS[s] for s in bench.scenarios},
        "skipped": bench.skipped,
        "simple_batching": servers.SIMPLE_DYNAMIC_BATCHING.strip(),
        "profiles": bench.profiles,
        "points": bench.points,
    }
    report.write(run, args.out)
    print(f"bench done in {run['seconds']:.0f} s: {args.out / 'results.md'}, results.json, qps_p99.png, side_by_side.png", flush=True)
    fleet = ["--quick"] if args.quick else []  # many models on few NPUs: on demand under a memory budget
    subprocess.run([sys.executable, str(BENCH / "fleet.py"), "--out", str(args.out), *fleet], check=True)
    if "yolov8n" in args.models:  # the detection chain
        detect = ["--quick"] if args.quick else []
        subprocess.run([sys.executable, str(BENCH / "detect.py"), "--out", str(args.out), *detect], check=True)


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.machine())
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
