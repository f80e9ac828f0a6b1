"""JSON over HTTP with `hey` (Go, the CANN inference-server measurements' tool): closed loop, fixed duration."""

from __future__ import annotations

import csv
import io
import subprocess
from pathlib import Path

from summary import summarize


def command(url: str, body: Path, concurrency: int, seconds: float) -> list[str]:
    return [
        "hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST",
        # hey sends text/html by default; stock KServe reads a body without a JSON type as binary.
        "-T", "application/json", "-D", str(body),
        # hey asks for gzip by default and the servers honour it; Triton's clients do not ask.
        "-disable-compression",
        "-o", "csv", url,
    ]


def hey(url: str, body: Path, concurrency: int, seconds: float) -> list[dict]:
    """One run: a row per response, whatever its status (hey leaves requests that got none, such as
    connection errors, out of its CSV). Columns: response-time, DNS+dialup, DNS, Request-write,
    Response-delay, Response-read, status-code, offset (times in seconds)."""
    done = subprocess.run(command(url, body, concurrency, seconds), capture_output=True, text=True, check=True, timeout=seconds + 60)
    return list(csv.DictReader(io.StringIO(done.stdout)))


def load(url: str, body: Path, concurrency: int, duration: float, warmup: float) -> dict:
    """A discarded warm-up run, then the measured one; only requests answered within `duration` count.
    `answered` counts every response of both runs, for the server's CPU per request."""
    rows = hey(url, body, concurrency, warmup) if warmup else []
    measured = hey(url, body, concurrency, duration)
    latencies, errors = [], 0
    for row in measured:
        latency, offset = float(row["response-time"]), float(row["offset"])
        if offset + latency > duration:
            continue
        if row["status-code"] == "200":
            latencies.append(latency)
        else:
            errors += 1
    return {**summarize(latencies, duration, errors), "answered": len(rows) + len(measured)}
