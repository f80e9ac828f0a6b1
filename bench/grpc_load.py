"""Closed-loop gRPC load: N tritonclient clients, each sending its next request when the last one is answered.

    python bench/grpc_load.py --url 127.0.0.1:8001 --model yolov8n --concurrency 10 --duration 6 --warmup 1

Prints one JSON summary (see summary.py). Runs as its own process: the bench must not
import tritonclient.grpc beside kserve (kserve/kserve#3099), and the load must not share
a GIL with anything else. Inputs travel as raw bytes (`raw_input_contents`), as
tritonclient sends them; that is the point of gRPC for a [1,3,640,640] FP32 image.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from payloads import inputs
from summary import summarize


class Window:
    """The measured interval: opens once the warm-up is over and every client has had an answer
    (so a slow model's pipeline is full), and closes `duration` seconds later."""

    def __init__(self, clients: int, warmup: float, duration: float):
        self.warm_until = time.perf_counter() + warmup
        self.duration = duration
        self.unanswered = set(range(clients))
        self.start: float | None = None
        self.latencies: list[float] = []
        self.errors = 0
        self.first_error = ""
        self.total = 0  # every answer, warm-up and late ones too: the server's work

    def open(self) -> bool:
        """Whether clients should send another request."""
        return self.start is None or time.perf_counter() < self.start + self.duration

    def answered(self, client: int, sent: float, error: str | None = None) -> None:
        done = time.perf_counter()
        self.total += 1
        if self.start is None:
            self.unanswered.discard(client)
            if not self.unanswered and done >= self.warm_until:
                self.start = done
            return
        if done > self.start + self.duration:
            return  # answered after the window: neither counted nor timed
        if error is None:
            self.latencies.append(done - sent)
        else:
            self.errors += 1
            self.first_error = self.first_error or error


async def client(number: int, url: str, model: str, window: Window) -> None:
    arrays = inputs(model)
    request = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        request.append(tensor)
    async with grpcclient.InferenceServerClient(url) as connection:
        while window.open():
            sent = time.perf_counter()
            try:
                await connection.infer(model, request)
            except InferenceServerException as error:
                window.answered(number, sent, str(error))
            else:
                window.answered(number, sent)


async def load(url: str, model: str, concurrency: int, duration: float, warmup: float) -> dict:
    window = Window(concurrency, warmup, duration)
    await asyncio.gather(*(client(i, url, model, window) for i in range(concurrency)))
    return {**summarize(window.latencies, duration, window.errors), "first_error": window.first_error, "answered": window.total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="host:port of the gRPC endpoint")
    parser.add_argument("--model", required=True)
    parser.add_argument("-c", "--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of the same load before measuring")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(load(args.url, args.model, args.concurrency, args.duration, args.warmup))))


if __name__ == "__main__":
    main()
