"""The tail at c=64 over JSON (hey): kserve-ascend as it is, without its settled heap
(kserve_ascend/core/heap.py), and without the garbage collector, twice each, alternating.

    python bench/grpc_floor/tail.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
import hey_load
import payloads
import servers

from conformance.harness import free_port, start, stop_server

UNSETTLED = "import kserve_ascend.core.heap as heap; heap.settle = lambda what: 0"
VARIANTS = [("settled", "pass"), ("unsettled", UNSETTLED), ("gc off", UNSETTLED + "; gc.disable()")] * 2


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
    servers.make_repositories(workdir)
    body = workdir / "simple.json"
    body.write_bytes(payloads.json_body("simple"))
    for label, before in VARIANTS:
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        argv = ["kserve_ascend", "--model_dir", str(workdir / "repository-batch"), "--model_control_mode", "explicit",
                "--load_model", "simple", "--http_port", str(http_port), "--grpc_port", str(grpc_port),
                "--metrics_port", str(metrics_port)]  # fmt: skip
        code = f"import gc, runpy, sys; {before}; sys.argv = {argv!r}; runpy.run_module('kserve_ascend', run_name='__main__')"
        server = start([sys.executable, "-c", code], workdir / "server.log", http_port, grpc_port, metrics_port, name=label)
        try:
            point = hey_load.load(f"{server.url}/v2/models/simple/infer", body, 64, 6, 2)
        finally:
            stop_server(server, check=False)
        print(f"{label:9s} {point['qps']:7.0f}/s p50 {point['p50_ms']:5.1f} p99 {point['p99_ms']:5.1f} ms", flush=True)


if __name__ == "__main__":
    main()
