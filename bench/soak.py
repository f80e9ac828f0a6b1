"""Memory under sustained load, and overload: does the server's RSS stay flat, does it answer everything?

    python bench/soak.py [--models simple yolov8n] [--minutes 10] [--concurrency 64]
    python bench/soak.py --connections 1000 [--models simple sim] [--minutes 5] [--workers 2] [--max_queue_size 64]

Memory soak (default): for each model, a kserve_ascend server (dynamic batching, as committed)
under a closed gRPC load (grpc_load.py) for the whole run, its resident memory sampled every
10 s. The first minute fills the high-water marks (tensors in flight, ORT's arenas, pooled
buffers); a leak shows as growth after it. Errors are reported three ways: failed requests
(and the first one's message), tracebacks in the server's log, and whether the server exited.
Writes bench/results/soak.md and soak.json.

Overload (`--connections N`): each model gets a queue policy of `--max_queue_size`, and N HTTP
connections each send their next request as soon as the last is answered, far more than the
model serves: every request must be answered 200 or 503 (queue full: the client retries), no
connection dropped, memory bounded. Prints, every 10 s, answers/s by status and the server's
RSS (all its processes); at the end the status counts, p50/p99 latency of each status, the
first error of each kind. Writes bench/results/overload.md and overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import servers
from payloads import json_body

BENCH = Path(__file__).resolve().parent
SAMPLE_S = 10
SETTLE_S = 60


def soak(model: str, seconds: float, concurrency: int, workdir: Path, logs: Path) -> dict:
    with servers.running("batch", workdir, logs) as server:
        load = subprocess.Popen(
            [sys.executable, str(BENCH / "grpc_load.py"), "--url", server.grpc, "--model", model,
             "--concurrency", str(concurrency), "--duration", str(seconds), "--warmup", "0"],
            stdout=subprocess.PIPE, text=True,
        )
        started, samples = time.monotonic(), []
        while load.poll() is None and server.process.poll() is None:
            samples.append((round(time.monotonic() - started), round(servers.rss_mb(server), 1)))
            print(f"{model:8s} t={samples[-1][0]:4d} s  rss {samples[-1][1]:7.1f} MiB", flush=True)
            time.sleep(SAMPLE_S)
        summary = json.loads(load.communicate()[0])  # a dead server fails the rest of the load fast
        exit_code = server.process.poll()
        tracebacks = server.output().count("Traceback")
    settled = [rss for t, rss in samples if t >= SETTLE_S] or [samples[-1][1]]
    return {
        "model": model, "concurrency": concurrency, "seconds": seconds, "requests": summary["count"],
        "errors": summary["errors"], "first_error": summary["first_error"], "server_tracebacks": tracebacks,
        "server_exit_code": exit_code, "qps": summary["qps"], "samples": samples,
        "rss_settled_mb": settled[0], "rss_end_mb": settled[-1], "rss_max_mb": max(settled),
        "growth_after_settling_mb": settled[-1] - settled[0],
    }


def write(results: list[dict], out: Path) -> None:
    (out / "soak.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# kserve-ascend memory soak", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · `python bench/soak.py` · kserve_ascend with dynamic batching, "
        f"closed gRPC load · RSS of the server process sampled every {SAMPLE_S} s; \"settled\" is the first sample after {SETTLE_S} s.", "",
        "| model | c | minutes | requests | errors | server tracebacks | server exited | QPS | RSS settled | RSS end "
        "| RSS max after settling | growth after settling |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        exited = "no" if r["server_exit_code"] is None else f"yes ({r['server_exit_code']})"
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['seconds'] / 60:g} | {r['requests']:,} | {r['errors']} "
            f"| {r['server_tracebacks']} | {exited} | {r['qps']:,.1f} | {r['rss_settled_mb']:.0f} MiB | {r['rss_end_mb']:.0f} MiB "
            f"| {r['rss_max_mb']:.0f} MiB | {r['growth_after_settling_mb']:+.0f} MiB |"
        )
    lines += [f"\nFirst error ({r['model']}): `{r['first_error']}`" for r in results if r["first_error"]]
    (out / "soak.md").write_text("\n".join(lines) + "\n")


class Overload:
    """N closed-loop HTTP clients on N connections: status counts, latencies by status, answers per 10 s."""

    def __init__(self, url: str, body: bytes, connections: int, seconds: float):
        self.url, self.body, self.connections, self.seconds = url, body, connections, seconds
        self.latencies: dict[int, list[float]] = collections.defaultdict(list)
        self.first_errors: dict[str, str] = {}
        self.failed_connections: collections.Counter = collections.Counter()
        self.window: collections.Counter = collections.Counter()  # statuses since the last sample

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.connections)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
            deadline = time.monotonic() + self.seconds
            await asyncio.gather(*(self._client(session, deadline) for _ in range(self.connections)))

    async def _client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                async with session.post(self.url, data=self.body, headers={"content-type": "application/json"}) as response:
                    answer = await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                self.failed_connections[type(error).__name__] += 1
                continue
            self.latencies[response.status].append(time.perf_counter() - start)
            self.window[response.status] += 1
            if response.status != 200:
                try:
                    text = json.loads(answer)["error"]
                except (ValueError, KeyError, TypeError):
                    text = answer.decode(errors="replace")
                kind = re.split(r"[:\d]", text, maxsplit=1)[0].strip()  # "Exceeds maximum queue size"
                self.first_errors.setdefault(f"{response.status} {kind}", text[:300])


def limit_queues(workdir: Path, max_queue_size: int) -> None:
    """Every batching model of the "batch" scenario's repository gets a queue of `max_queue_size`."""
    for config in (workdir / "repository-batch").glob("*/config.pbtxt"):
        policy = f"dynamic_batching {{ default_queue_policy {{ max_queue_size: {max_queue_size} }}"
        config.write_text(config.read_text().replace("dynamic_batching {", policy, 1))


def overload(model: str, seconds: float, connections: int, workers: int, workdir: Path, logs: Path) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 1024)), hard))
    with servers.running("workers2" if workers == 2 else "batch", workdir, logs) as server:
        load = Overload(f"{server.url}/v2/models/{model}/infer", json_body(model), connections, seconds)
        thread = threading.Thread(target=asyncio.run, args=(load.run(),))
        started, samples = time.monotonic(), []
        thread.start()
        while thread.is_alive():
            last = time.monotonic()
            thread.join(SAMPLE_S)
            window, load.window = load.window, collections.Counter()
            now = time.monotonic()
            samples.append({"t": round(now - started), "rss_mb": round(servers.rss_mb(server), 1),
                            "per_s": {status: round(n / (now - last), 1) for status, n in sorted(window.items())}})
            sample = samples[-1]
            print(f"{model:8s} t={sample['t']:4d} s  rss {sample['rss_mb']:7.1f} MiB  answers/s {sample['per_s']}", flush=True)
        exit_code = server.process.poll()
        tracebacks = server.output().count("Traceback")
    count = sum(len(v) for v in load.latencies.values())
    return {
        "model": model, "connections": connections, "workers": workers, "seconds": seconds,
        "answers": count, "answers_per_s": count / seconds,
        "statuses": {status: len(v) for status, v in sorted(load.latencies.items())},
        "latency_ms": {status: {"p50": float(np.percentile(v, 50) * 1000), "p99": float(np.percentile(v, 99) * 1000)}
                       for status, v in sorted(load.latencies.items())},
        "failed_connections": dict(load.failed_connections), "first_errors": load.first_errors,
        "server_tracebacks": tracebacks, "server_exit_code": exit_code, "samples": samples,
        "rss_first_mb": samples[0]["rss_mb"], "rss_max_mb": max(s["rss_mb"] for s in samples), "rss_end_mb": samples[-1]["rss_mb"],
    }


def write_overload(results: list[dict], out: Path) -> None:
    (out / "overload.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# kserve-ascend under overload", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · `python bench/soak.py --connections N` · closed HTTP load, "
        f"each connection sends its next request once answered · RSS of the server's processes sampled every {SAMPLE_S} s.", "",
        "| model | connections | workers | queue | minutes | answers/s | 200 | 503 | other | failed connections "
        "| p99 200 | p99 503 | server tracebacks | server exited | RSS first | RSS max | RSS end |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        statuses, p99 = r["statuses"], {s: v["p99"] for s, v in r["latency_ms"].items()}
        other = sum(n for s, n in statuses.items() if s not in (200, 503))
        exited = "no" if r["server_exit_code"] is None else f"yes ({r['server_exit_code']})"
        lines.append(
            f"| {r['model']} | {r['connections']} | {r['workers']} | {r['max_queue_size']} | {r['seconds'] / 60:g} "
            f"| {r['answers_per_s']:,.0f} | {statuses.get(200, 0):,} | {statuses.get(503, 0):,} | {other} "
            f"| {sum(r['failed_connections'].values())} | {p99.get(200, 0):.0f} ms | {p99.get(503, 0):.0f} ms "
            f"| {r['server_tracebacks']} | {exited} | {r['rss_first_mb']:.0f} MiB | {r['rss_max_mb']:.0f} MiB | {r['rss_end_mb']:.0f} MiB |"
        )
    lines += [f"\n{r['model']}, first `{kind}`: `{text}`" for r in results for kind, text in r["first_errors"].items()]
    (out / "overload.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help="default: simple yolov8n (memory soak), simple sim (overload)")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=64, help="memory soak: gRPC clients")
    parser.add_argument("--connections", type=int, help="overload: this many HTTP connections instead of the memory soak")
    parser.add_argument("--workers", type=int, default=1, choices=[1, 2], help="overload: the server's --workers")
    parser.add_argument("--max_queue_size", type=int, default=64, help="overload: every model's queue policy")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kserve-ascend-soak-") as tmp:
        servers.make_repositories(Path(tmp))
        if args.connections:
            limit_queues(Path(tmp), args.max_queue_size)
            results = [
                overload(m, args.minutes * 60, args.connections, args.workers, Path(tmp), args.out / "logs") | {"max_queue_size": args.max_queue_size}
                for m in args.models or ["simple", "sim"]
            ]
            write_overload(results, args.out)
            print((args.out / "overload.md").read_text())
            return
        models = args.models or ["simple", "yolov8n"]
        results = [soak(m, args.minutes * 60, args.concurrency, Path(tmp), args.out / "logs") for m in models]
    write(results, args.out)
    print((args.out / "soak.md").read_text())


if __name__ == "__main__":
    main()
