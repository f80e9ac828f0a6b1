"""JSON over HTTP with `hey` (Go, the CANN inference-server measurements' tool): closed loop, fixed duration."""

from __future__ import annotations

import csv
import io
import subprocess
from pathlib import Path

from summary import summarize


def hey(url: str, body: Path, concurrency: int, seconds: float, csv_output: bool = True) -> str:
    command = [
        "hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST",
        # hey sends text/html by default; stock KServe reads a body without a JSON type as binary.
        "-T", "application/json", "-D", str(body),
    ]
    if csv_output:
        command += ["-o", "csv"]
    return subprocess.run(command + [url], capture_output=True, text=True, check=True, timeout=seconds + 60).stdout


def load(url: str, body: Path, concurrency: int, duration: float, warmup: float) -> dict:
    """A discarded warm-up run, then the measured one; only requests answered within `duration` count."""
    if warmup:
        hey(url, body, concurrency, warmup, csv_output=False)
    latencies, errors = [], 0
    # Columns: response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset (seconds).
    for row in csv.DictReader(io.StringIO(hey(url, body, concurrency, duration))):
        latency, offset = float(row["response-time"]), float(row["offset"])
        if offset + latency > duration:
            continue
        if row["status-code"] == "200":
            latencies.append(latency)
        else:
            errors += 1
    return summarize(latencies, duration, errors)
