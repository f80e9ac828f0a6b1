"""Keeping what a serving process loaded at start out of the garbage collector's full collections.

CPython's collection of its oldest generation walks every object the collector tracks. Once kserve,
FastAPI, pydantic, protobuf, onnxruntime and the models are imported and loaded, that is hundreds of
thousands of objects, and a full collection holds the GIL for tens of milliseconds: under load it
lands on a request every second or so, and it is the p99. Measured on `simple` over JSON at c=64 (hey,
2-core machine): p99 72-85 ms with the collector as it is, 16-17 ms with it disabled, 20-25 ms with
the start-up heap frozen, median unchanged (bench/grpc_floor/tail.py, issue 28's note).
`gc.freeze` (Python >= 3.7) moves what exists into a generation no collection visits; what requests
allocate is collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def settle(what: str) -> int:
    """Collects the garbage there is, then freezes what is left alive: call once a process has loaded what
    it serves with (`what` says so in the log). Returns how many objects are now frozen."""
    gc.collect()  # first, so that garbage is collected rather than frozen
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects kept out of the garbage collector's full collections", what, frozen)
    return frozen
