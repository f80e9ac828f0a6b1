"""Memory under sustained load: is the server's RSS flat, or does it grow with the requests served?

    python bench/soak.py [--models simple yolov8n] [--minutes 10] [--concurrency 64]

For each model: a kserve_ascend server (dynamic batching, as committed) under a closed
gRPC load (grpc_load.py) for the whole run, its resident memory sampled every 10 s. The
first minute fills the high-water marks (tensors in flight, ORT's arenas, pooled buffers);
a leak shows as growth after it. Errors are reported three ways: failed requests (and the
first one's message), tracebacks in the server's log, and whether the server exited.
Writes bench/results/soak.md and soak.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import servers

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["simple", "yolov8n"])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kserve-ascend-soak-") as tmp:
        servers.make_repositories(Path(tmp))
        results = [soak(m, args.minutes * 60, args.concurrency, Path(tmp), args.out / "logs") for m in args.models]
    write(results, args.out)
    print((args.out / "soak.md").read_text())


if __name__ == "__main__":
    main()
