"""The executor ceiling: the core's instance called in-process at max_batch_size, no server, no client.

    python bench/raw.py --model yolov8n [--batch 8] --duration 6 --warmup 1

Prints one JSON summary whose qps is rows/s and whose latencies are those of one batch.
The model loads through the core exactly as the servers load it (config.pbtxt, runtime options).
"""

from __future__ import annotations

import argparse
import json
import time

from kserve_ascend.core.models.model import Model

from payloads import inputs, model_dir
from summary import summarize


def ceiling(model_name: str, duration: float, warmup: float, batch_size: int = 0) -> dict:
    model = Model(model_name, model_dir(model_name))
    model.load()  # raises with the reason if it does not
    try:
        version = model.versions[max(model.versions)]
        rows = batch_size or max(version.config.max_batch_size, 1)
        instance, batch = version.instances[0], [inputs(model_name, rows)]
        deadline = time.perf_counter() + warmup
        while time.perf_counter() < deadline:
            instance.run_batch(batch)
        latencies, end = [], time.perf_counter() + duration
        while (start := time.perf_counter()) < end:
            instance.run_batch(batch)
            latencies.append(time.perf_counter() - start)
        # The window is the time the calls took: the last one may end after `end`.
        return {**summarize(latencies, sum(latencies), rows_per_call=rows), "batch": rows}
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=0, help="rows per call (default: the model's max_batch_size)")
    args = parser.parse_args()
    print(json.dumps(ceiling(args.model, args.duration, args.warmup, args.batch)))


if __name__ == "__main__":
    main()
