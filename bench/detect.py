"""The detection chain (yolov8n_detect): where an image's time goes, in-process and through the server.

    python bench/detect.py [--iterations 30] [--duration 10] [--concurrency 2] [--quick] [--out bench/results]

1. In-process, on the instance's own runtime: pre-processing (decode + letterbox), execution
   (the detector) and post-processing (decode + NMS + mapping back) timed apart, for a
   1280x720 JPEG and a 640x640 PNG.
2. Through the KServe server: tritonclient sends the JPEG as a BYTES tensor over HTTP and
   gRPC from `concurrency` threads for `duration` seconds.
Writes detect.md in `--out` (and prints it); `--quick` (3 iterations, 1 s) in bench/results/quick/.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageDraw

from servers import REPOSITORY, start_server, stop_server
from summary import summarize

from kserve_ascend.core.model import Model
from kserve_ascend.core.processing import yolo

MODEL = "yolov8n_detect"
RESULTS = Path(__file__).resolve().parent / "results"


def picture(fmt: str, size: tuple[int, int]) -> bytes:
    """A camera-sized frame with some structure (noise keeps the JPEG realistic in size)."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8) // 4 + 96
    frame = Image.fromarray(pixels)
    draw = ImageDraw.Draw(frame)
    draw.rectangle((size[0] // 5, size[1] // 3, size[0] // 2, size[1] * 4 // 5), fill=(200, 30, 30))
    draw.ellipse((size[0] * 2 // 3, 20, size[0] * 5 // 6, size[1] // 3), fill=(250, 220, 0))
    buffer = io.BytesIO()
    frame.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def phases(data: bytes, iterations: int) -> dict[str, float]:
    """Mean milliseconds of each phase of the chain on one instance, after one warm-up run."""
    model = Model(MODEL, REPOSITORY / MODEL)
    model.load()
    try:
        runtime = model.versions[max(model.versions)].instances[0].runtime
        inputs = {"image": np.array([data], dtype=object)}
        options = yolo.DetectionOptions(score_threshold=0.0001)  # random weights: keep NMS busy with 100 boxes
        totals = np.zeros(3)
        for i in range(iterations + 1):
            t0 = time.perf_counter()
            tensor, frame = runtime.preprocess(inputs)
            t1 = time.perf_counter()
            output = runtime.execute(tensor)
            t2 = time.perf_counter()
            runtime.postprocess(output, frame, options)
            t3 = time.perf_counter()
            if i:
                totals += (t1 - t0, t2 - t1, t3 - t2)
        pre, execute, post = totals / iterations * 1000
        return {"pre_ms": pre, "exec_ms": execute, "post_ms": post}
    finally:
        model.close()


def load(module, url: str, data: bytes, concurrency: int, duration: float) -> dict:
    latencies: list[float] = []
    errors = [0]
    start = time.perf_counter()
    deadline = start + duration

    def client() -> None:
        with module.InferenceServerClient(url) as connection:
            tensor = module.InferInput("image", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([data], dtype=object))
            while (begin := time.perf_counter()) < deadline:
                try:
                    connection.infer(MODEL, [tensor])
                    latencies.append(time.perf_counter() - begin)
                except Exception:
                    errors[0] += 1

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarize(latencies, time.perf_counter() - start, errors[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 iterations, 1 s per protocol: checks it runs")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (bench/results/quick with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.duration = 3, 1.0
    out = args.out or RESULTS / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    jpeg, png = picture("JPEG", (1280, 720)), picture("PNG", (640, 640))
    lines = [
        "# Detection chain: yolov8n_detect", "",
        f"One run on this machine ({time.strftime('%Y-%m-%d')}); CPU onnxruntime, random weights, score_threshold 0.0001",
        "so that NMS works on every anchor and keeps 100 boxes (the worst case for post-processing).", "",
        "## Where the time goes (in-process, one instance)", "",
        "| image | pre-processing | execution | post-processing |", "| --- | ---: | ---: | ---: |",
    ]
    for name, data in ((f"JPEG 1280x720, {len(jpeg) // 1024} KiB", jpeg), (f"PNG 640x640, {len(png) // 1024} KiB", png)):
        p = phases(data, args.iterations)
        total = sum(p.values())
        lines.append(
            f"| {name} | {p['pre_ms']:.1f} ms ({p['pre_ms'] / total:.0%}) | {p['exec_ms']:.1f} ms ({p['exec_ms'] / total:.0%}) "
            f"| {p['post_ms']:.1f} ms ({p['post_ms'] / total:.0%}) |"
        )
    lines += [
        "", f"## Through the KServe server (JPEG 1280x720 as a BYTES tensor, concurrency {args.concurrency}, {args.duration:.0f} s)", "",
        "| protocol | images/s | mean | p50 | p99 | errors |", "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(REPOSITORY, Path(workdir) / "server.log")
        try:
            for protocol, module, url in (("HTTP", httpclient, server.http), ("gRPC", grpcclient, server.grpc)):
                load(module, url, jpeg, args.concurrency, 1.0)  # warm-up
                r = load(module, url, jpeg, args.concurrency, args.duration)
                lines.append(
                    f"| {protocol} | {r['qps']:.1f} | {r['mean_ms']:.1f} ms | {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms | {r['errors']} |"
                )
        finally:
            stop_server(server)
    lines += [
        "", "The model has one instance and the chain runs whole on it, so a request waits for the one before it:",
        "at concurrency 2 the latency is about twice the service time (1 / images per second); what that service time",
        "adds to the in-process total is the protocol, the queue and the client, which share the machine's cores.",
    ]
    report = "\n".join(lines) + "\n"
    (out / "detect.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
