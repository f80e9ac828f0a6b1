"""`--serve NAME`: a server of this project started for one run of the suite, and stopped after it.

It serves conformance/models with explicit model control and every model loaded at start-up
(the repository cases unload and load models), with a response cache of harness.CACHE_SIZE bytes
(the cache cases), on free ports, reached over loopback.
Only this path needs the project's servers (started by the harness tests/ uses too); the cases
never import them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from conformance import harness

MODELS = harness.ROOT / "conformance" / "models"
SERVERS = ("kserve-ascend", "triton")
#: Loading conformance/models takes seconds; Triton starts a Python stub per model instance first.
READY_TIMEOUT_S = 120


#: kserve-ascend's flags for the suite (Triton's below): every model loaded, explicit control, a response cache
#: (cases/test_cache.py), and the rate limiter on with the one resource `rate_limited` needs (cases/test_rate_limiter.py).
KSERVE_ASCEND_FLAGS = (
    "--model_control_mode", "explicit", "--load_model", "*", "--cache_config", f"local,size={harness.CACHE_SIZE}",
    "--rate_limit", "execution_count", "--rate_limit_resource", "conformance_slot:1",
)  # fmt: skip


def start(name: str, workdir: Path) -> harness.Server:
    if name == "kserve-ascend":
        log = workdir / "kserve-ascend.log"
        return harness.start_server(MODELS, log, *KSERVE_ASCEND_FLAGS, workers=1, timeout=READY_TIMEOUT_S)
    return harness.start_triton(
        MODELS, workdir, "--model-control-mode=explicit", "--load-model=*", f"--cache-config=local,size={harness.CACHE_SIZE}",
        "--rate-limit=execution_count", "--rate-limit-resource=conformance_slot:1",
        # Loopback only (metrics follows the HTTP address); kserve-ascend, like KServe, binds every interface.
        "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", timeout=READY_TIMEOUT_S,
    )  # fmt: skip


@contextlib.contextmanager
def served(name: str, workdir: Path) -> Iterator[tuple[str, str]]:
    """Starts server `name` (its log in workdir), yields its (HTTP, gRPC) HOST:PORT once ready, then stops it;
    harness.NotReady if it exits or is not ready in time."""
    server = start(name, workdir)
    try:
        yield server.http, server.grpc
    finally:
        harness.stop_server(server)
