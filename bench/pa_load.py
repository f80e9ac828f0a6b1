"""Binary HTTP and gRPC loads with perf_analyzer, Triton's load generator (C++; tools/perf_analyzer.py): closed loop.

perf_analyzer runs `concurrency` clients, each sending its next request when the last is
answered, with random tensors of the shapes the model's metadata declares; over HTTP the
tensors travel as binary data (Triton's binary tensor extension), over gRPC as raw bytes.
It needs Triton's model configuration extension, which stock KServe lacks. Its figures are
the mean of three equal windows after a discarded warm-up run, with the server-side queue
and compute times it reads from the statistics extension.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER = ROOT / "tools" / "perf_analyzer.py"
WINDOWS = 3  # perf_analyzer's least: stability is judged over the last three windows
#: perf_analyzer fails a window in which no request finished (batches finish together, yolov8n's in
#: seconds on a busy machine): windows of at least a second, doubled (up to 8 s) while that happens.
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 8.0
NONE_FINISHED = "No valid requests recorded within time interval"
#: perf_analyzer's CSV columns of the server side (microseconds per request) -> the point's keys.
SERVER_COLUMNS = {
    "Server Queue": "server_queue_us",
    "Server Compute Input": "server_compute_input_us",
    "Server Compute Infer": "server_compute_infer_us",
    "Server Compute Output": "server_compute_output_us",
}


def command(server, model: str, protocol: str, concurrency: int, window_s: float, csv_path: Path) -> list[str]:
    """WINDOWS windows of `window_s`, taken as they come (any spread counts as stable)."""
    if protocol == "grpc":
        where = ["-i", "grpc", "-u", server.grpc]
    else:
        where = ["-u", server.http, "--input-tensor-format", "binary", "--output-tensor-format", "binary"]
    return [
        sys.executable, str(PERF_ANALYZER), "-m", model, *where,
        "--concurrency-range", str(concurrency),
        "--measurement-interval", str(max(round(window_s * 1000), 1)),
        "--max-trials", str(WINDOWS), "--stability-percentage", "10000",
        "-f", str(csv_path), "--verbose-csv",
    ]


def perf_analyzer(server, model: str, protocol: str, concurrency: int, window_s: float, csv_path: Path) -> subprocess.CompletedProcess:
    run = command(server, model, protocol, concurrency, window_s, csv_path)
    return subprocess.run(run, capture_output=True, text=True, timeout=WINDOWS * window_s * 10 + 120)


def load(server, model: str, protocol: str, concurrency: int, duration: float, warmup: float, workdir: Path) -> dict:
    """A warm-up run (its figures, and its failure if no request finished in a short window, discarded),
    then the measured one, of `duration` (see MIN_WINDOW_S); a run that fails is a point with its error."""
    csv_path = workdir / "perf_analyzer.csv"
    if warmup:
        perf_analyzer(server, model, protocol, concurrency, warmup / WINDOWS, csv_path)
    window_s = max(duration / WINDOWS, MIN_WINDOW_S)
    run = perf_analyzer(server, model, protocol, concurrency, window_s, csv_path)
    while run.returncode and NONE_FINISHED in run.stdout + run.stderr and window_s < MAX_WINDOW_S:
        window_s *= 2
        run = perf_analyzer(server, model, protocol, concurrency, window_s, csv_path)
    if run.returncode:
        error = (run.stdout + run.stderr).strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        return {"qps": 0.0, "mean_ms": None, "p50_ms": None, "p99_ms": None, "count": 0, "errors": 1,
                "window_s": WINDOWS * window_s, "first_error": error[0]}
    with open(csv_path) as file:
        [row] = list(csv.DictReader(file))
    count = re.search(r"Request count: (\d+)", run.stdout)
    return {
        "qps": float(row["Inferences/Second"]),
        "mean_ms": int(row["Avg latency"]) / 1000,
        "p50_ms": int(row["p50 latency"]) / 1000,
        "p99_ms": int(row["p99 latency"]) / 1000,
        "count": int(count.group(1)) if count else None,
        "errors": 0,
        "window_s": WINDOWS * window_s,
        # perf_analyzer leaves them out for a server without Triton's statistics extension.
        **{key: int(row[column]) for column, key in SERVER_COLUMNS.items() if column in row},
    }
