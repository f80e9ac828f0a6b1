"""Many models on a few NPUs: a fleet served on demand under a memory budget (issue 30).

    python bench/fleet.py [--duration 20] [--workers 1] [--quick] [--out bench/results]

30 `sim` models of 100 MB each (`sim_memory_mb`: really allocated, and what each holds) under
`--memory_budget_mb 1000 --load_on_demand`, so at most 10 are loaded at once. 16 clients send
requests, each its next as soon as the last is answered, spread over all 30 with a skewed
popularity: the hot set of 8 is asked for once first, then in every run of 33 requests each hot
model is asked 4 times and one cold model once (the 22 cold ones in turn). Sampled every quarter second: the models loaded, from the
repository index and from /metrics. Reported:
- the cold-start wait: what requests waited for their model's load (the server's
  `ascend_model_load_wait_seconds`: mean, and the bucket that holds the 99th percentile);
- the warm latency: p50 and p99 of the requests for the hot models, which stay loaded;
- the hit rate: the share of requests that found their model loaded (1 - waits / requests).
Writes fleet.md and fleet.json in `--out`; `--quick` (4 s) in bench/results/quick/.

`drive` is the load the fleet test (tests/test_fleet.py) runs too, with its own assertions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from conformance.harness import Metrics, post_infer, scrape, start_server, stop_server  # noqa: E402

MODELS = 30
HOT = 8
MEMORY_MB = 100
BUDGET_MB = 1000
CONCURRENCY = 16
#: In each run of requests: every hot model this many times, then one cold model.
HOT_REPEATS = 4
SAMPLE_S = 0.25


def names(count: int = MODELS) -> list[str]:
    return [f"model{i:02d}" for i in range(count)]


def write_sim_repository(root: Path, count: int = MODELS, memory_mb: float = MEMORY_MB) -> Path:
    """`count` sim models (output = input) of `memory_mb` each, in Triton's layout."""
    for name in names(count):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.sim").write_bytes(b"")
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 8\n'
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'parameters { key: "sim_fixed_ms" value: { string_value: "1" } }\n'
            f'parameters {{ key: "sim_memory_mb" value: {{ string_value: "{memory_mb}" }} }}\n'
        )
    return root


def schedule(models: list[str], hot: int = HOT) -> list[str]:
    """One cycle of the skewed popularity: per cold model, HOT_REPEATS rounds of the hot set, then that cold model."""
    hot_set, cold = models[:hot], models[hot:]
    return [m for c in cold for m in [*hot_set * HOT_REPEATS, c]]


@dataclass
class Fleet:
    """What a run saw: every answer, and the loaded models at every sample."""

    requests: int = 0
    failures: list[str] = field(default_factory=list)
    correct: Counter = field(default_factory=Counter)  # model -> correct answers
    latency_s: dict[str, list[float]] = field(default_factory=dict)
    #: per sample: (models READY in the index, versions with ascend_model_memory_bytes in /metrics)
    samples: list[tuple[set[str], set[str]]] = field(default_factory=list)
    metrics: Metrics | None = None


def drive(
    server, models: list[str], seconds: float, concurrency: int = CONCURRENCY, hot: int = HOT,
    tensor: tuple[str, str] = ("INPUT0", "OUTPUT0"),
) -> Fleet:
    """`concurrency` closed-loop clients for `seconds` over `models` (the first `hot` of them hot), each request
    checked (output = input); the loaded models sampled from the index and /metrics meanwhile. It runs on past
    `seconds` until one whole cycle of the popularity was sent (every model asked for), 3 x `seconds` at most."""
    fleet = Fleet()
    cycle = schedule(models, hot)
    order = itertools.count()
    lock = threading.Lock()
    stop = threading.Event()
    source, target = tensor

    def body(value: float) -> dict:
        return {"inputs": [{"name": source, "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]}

    def client() -> None:
        with requests.Session() as session:
            while True:
                i = next(order)
                now = time.monotonic()
                if now > deadline + 2 * seconds or (now > deadline and i >= len(cycle)):
                    return
                model, value = cycle[i % len(cycle)], float(i % 4096)
                start = time.perf_counter()
                try:
                    answer = post_infer(server, model, body(value), timeout=60, session=session)
                    elapsed = time.perf_counter() - start
                    output = next(o for o in answer.json()["outputs"] if o["name"] == target) if answer.ok else None
                    ok = output is not None and output["data"] == [value] * 4
                    error = "" if ok else f"{model}: {answer.status_code} {answer.text[:300]}"
                except Exception as failure:  # noqa: BLE001 (any failure is the run's finding)
                    elapsed, ok, error = time.perf_counter() - start, False, f"{model}: {failure!r}"
                with lock:
                    fleet.requests += 1
                    if ok:
                        fleet.correct[model] += 1
                        fleet.latency_s.setdefault(model, []).append(elapsed)
                    else:
                        fleet.failures.append(error)

    def sampler() -> None:
        while not stop.wait(SAMPLE_S):
            index = requests.post(f"{server.url}/v2/repository/index", timeout=10).json()
            ready = {e["name"] for e in index if e.get("state") == "READY"}
            held = {s.labels["model"] for s in scrape(server).samples if s.name == "ascend_model_memory_bytes"}
            fleet.samples.append((ready, held))

    with requests.Session() as session:  # traffic begins with the hot set, each once, as a server's day does
        for model in models[:hot]:
            post_infer(server, model, body(0.0), timeout=60, session=session).raise_for_status()
    deadline = time.monotonic() + seconds
    watching = threading.Thread(target=sampler, daemon=True)
    watching.start()
    with ThreadPoolExecutor(concurrency) as pool:
        for done in [pool.submit(client) for _ in range(concurrency)]:
            done.result()
    stop.set()
    watching.join()
    fleet.metrics = scrape(server)
    return fleet


def report(fleet: Fleet, models: list[str], hot: int = HOT) -> dict:
    """The cold-start wait, the warm latency and the hit rate of a run."""
    metrics = fleet.metrics
    waits = sum(metrics.values("ascend_model_load_wait_seconds_count"))
    waited_s = sum(metrics.values("ascend_model_load_wait_seconds_sum"))
    buckets: Counter = Counter()
    for model in models:
        buckets.update(metrics.buckets("ascend_model_load_wait_seconds", model=model))
    p99_bound = next((bound for bound, count in sorted(buckets.items()) if count >= 0.99 * waits), None) if waits else None
    warm = sorted(s for model in models[:hot] for s in fleet.latency_s.get(model, []))
    loads = sum(metrics.values("ascend_model_loads", reason="on_demand"))
    return {
        "requests": fleet.requests,
        "failures": len(fleet.failures),
        "first_failure": fleet.failures[0] if fleet.failures else "",
        "models_answered": len(fleet.correct),
        "loads_on_demand": loads,
        "evictions": sum(metrics.values("ascend_model_evictions")),
        "evictions_of_hot_models": sum(v for m in models[:hot] for v in metrics.values("ascend_model_evictions", model=m)),
        "cold_start_wait_mean_ms": 1000 * waited_s / waits if waits else None,
        "cold_start_wait_p99_at_most_s": p99_bound,
        "warm_p50_ms": 1000 * statistics.median(warm) if warm else None,
        "warm_p99_ms": 1000 * warm[int(0.99 * (len(warm) - 1))] if warm else None,
        "hit_rate": 1 - waits / fleet.requests if fleet.requests else None,
        "most_loaded_index": max((len(r) for r, _ in fleet.samples), default=0),
        "most_loaded_metrics": max((len(h) for _, h in fleet.samples), default=0),
        "samples": len(fleet.samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--workers", type=int, default=1, help="the server's --workers")
    parser.add_argument("--quick", action="store_true", help="4 s: checks the scenario runs")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (bench/results/quick with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.duration = 4.0
    out = (args.out or ROOT / "bench" / "results" / ("quick" if args.quick else "")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kserve-ascend-fleet-") as tmp:
        repository = write_sim_repository(Path(tmp) / "repository")
        server = start_server(
            repository, out / "fleet-server.log", "--memory_budget_mb", str(BUDGET_MB), "--load_on_demand",
            workers=args.workers,
        )
        try:
            fleet = drive(server, names(), args.duration)
        finally:
            stop_server(server)
    result = {"duration_s": args.duration, "workers": args.workers, "models": MODELS, "hot": HOT,
              "memory_mb": MEMORY_MB, "budget_mb": BUDGET_MB, "concurrency": CONCURRENCY, **report(fleet, names())}
    (out / "fleet.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Many models on a few NPUs: the fleet on demand", "",
        f"{MODELS} sim models of {MEMORY_MB} MB under `--memory_budget_mb {BUDGET_MB} --load_on_demand`"
        f" (`--workers {args.workers}`), {CONCURRENCY} clients for {args.duration:g} s, {HOT} hot models asked"
        f" {HOT_REPEATS} times for each cold one. See bench/fleet.py.", "",
        "| figure | value |", "|---|---|",
        *(f"| {key} | {_shown(value)} |" for key, value in result.items()),
    ]
    (out / "fleet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def _shown(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
