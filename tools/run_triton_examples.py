"""Runs Triton's Python client examples against a running server: one pass/fail line each.

    python tools/run_triton_examples.py EXAMPLES_DIR [--http localhost:8080] [--grpc localhost:8081]

EXAMPLES_DIR is `src/python/examples` of github.com/triton-inference-server/client (branch
r24.10 for Triton 2.51; docs/triton-client-examples.md says how to fetch it). Only the examples
that page marks as passing with the repositories this project ships run here. One whose
models the server does not serve is skipped, naming them: `make serve` (model_repository/)
runs the sequence examples, `make serve MODEL_DIR=conformance/models` the string ones.
Exit status 1 if an example fails, or if none ran.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import tritonclient.http as httpclient

#: (script, protocol, extra arguments, models it infers on, text its stdout shows on success).
#: The examples exit 1 on a wrong result; the text guards against their bare `sys.exit()`
#: (status 0) and shows they ran to their last step.
EXAMPLES = [
    ("simple_http_infer_client.py", "http", [], ["simple"], "Request for unknown model"),
    ("simple_http_infer_client.py", "http",
     ["--request-compression-algorithm", "gzip", "--response-compression-algorithm", "gzip"], ["simple"],
     "Request for unknown model"),
    ("simple_http_infer_client.py", "http",
     ["--request-compression-algorithm", "deflate", "--response-compression-algorithm", "deflate"], ["simple"],
     "Request for unknown model"),
    ("simple_http_async_infer_client.py", "http", [], ["simple"], "15 - 1 = 14"),
    ("simple_http_aio_infer_client.py", "http", [], ["simple"], "PASS: infer"),
    ("simple_http_shm_client.py", "http", [], ["simple"], "PASS: system shared memory"),
    ("simple_http_sequence_sync_infer_client.py", "http", [], ["simple_sequence"], "PASS: Sequence"),
    ("simple_http_sequence_sync_infer_client.py", "http", ["-d"],
     ["simple_dyna_sequence", "simple_string_dyna_sequence"], "PASS: Sequence"),
    ("simple_http_shm_string_client.py", "http", [], ["simple_string"], "PASS: system shared memory"),
    ("simple_grpc_infer_client.py", "grpc", [], ["simple"], "PASS: infer"),
    ("simple_grpc_infer_client.py", "grpc", ["-C", "gzip"], ["simple"], "PASS: infer"),
    ("simple_grpc_infer_client.py", "grpc", ["-C", "deflate"], ["simple"], "PASS: infer"),
    ("simple_grpc_async_infer_client.py", "grpc", [], ["simple"], "PASS: Async infer"),
    ("simple_grpc_aio_infer_client.py", "grpc", [], ["simple"], "PASS: grpc aio infer"),
    ("simple_grpc_keepalive_client.py", "grpc", [], ["simple"], "PASS: KeepAlive"),
    ("simple_grpc_custom_args_client.py", "grpc", [], ["simple"], "PASS: CustomArgs"),
    ("simple_grpc_shm_client.py", "grpc", [], ["simple"], "PASS: system shared memory"),
    ("simple_grpc_sequence_sync_infer_client.py", "grpc", [], ["simple_sequence"], "PASS: Sequence"),
    ("simple_grpc_sequence_sync_infer_client.py", "grpc", ["-d"],
     ["simple_dyna_sequence", "simple_string_dyna_sequence"], "PASS: Sequence"),
    ("simple_grpc_sequence_stream_infer_client.py", "grpc", [], ["simple_sequence"], "PASS: Sequence"),
    ("simple_grpc_sequence_stream_infer_client.py", "grpc", ["-d"],
     ["simple_dyna_sequence", "simple_string_dyna_sequence"], "PASS: Sequence"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", "grpc", [], ["simple_sequence"],
     "PASS: grpc aio sequence stream"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", "grpc", ["-d"],
     ["simple_dyna_sequence", "simple_string_dyna_sequence"], "PASS: grpc aio sequence stream"),
    ("simple_grpc_shm_string_client.py", "grpc", [], ["simple_string"], "PASS: system shared memory"),
    ("grpc_explicit_int_content_client.py", "grpc", [], ["simple"], "PASS: explicit int"),
    ("grpc_explicit_byte_content_client.py", "grpc", [], ["simple_string"], "PASS: explicit string"),
    ("reuse_infer_objects_client.py", "http", ["-i", "http"], ["simple"], "END"),
    ("reuse_infer_objects_client.py", "grpc", ["-i", "grpc"], ["simple"], "END"),
    ("simple_grpc_custom_repeat.py", "grpc", [], ["repeat_int32"], "PASS: Decoupled API"),
]
TIMEOUT_S = 120


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("examples_dir", type=Path, help="src/python/examples of triton-inference-server/client")
    parser.add_argument("--http", default="localhost:8080", help="the server's HTTP host:port")
    parser.add_argument("--grpc", default="localhost:8081", help="the server's gRPC host:port")
    args = parser.parse_args()
    missing = sorted({script for script, *_ in EXAMPLES if not (args.examples_dir / script).is_file()})
    if missing:
        parser.error(f"{args.examples_dir} has no {', '.join(missing)}: is it src/python/examples?")

    server = httpclient.InferenceServerClient(args.http)
    try:
        ready = {model: server.is_model_ready(model) for model in {m for *_, models, _ in EXAMPLES for m in models}}
    except Exception as error:  # refused, reset, not HTTP: the server is not there to test
        parser.exit(1, f"no server answers on {args.http}: {error!r}\n")
    failed = ran = 0
    for script, protocol, extra, models, success in EXAMPLES:
        command = [script, "-u", args.http if protocol == "http" else args.grpc, *extra]
        shown = " ".join(command)
        absent = [model for model in models if not ready[model]]
        if absent:
            print(f"skip  {shown}  (the server has no {', '.join(absent)})")
            continue
        ran += 1
        try:
            result = subprocess.run([sys.executable, *command], cwd=args.examples_dir, capture_output=True,
                                    text=True, timeout=TIMEOUT_S)
            output = result.stdout + result.stderr
            passed = result.returncode == 0 and success in result.stdout
        except subprocess.TimeoutExpired:
            output, passed = f"no answer in {TIMEOUT_S} s", False
        print(f"{'pass' if passed else 'FAIL'}  {shown}")
        if not passed:
            failed += 1
            print("      " + "\n      ".join(output.strip().splitlines()[-10:]))
    print(f"{ran - failed} passed, {failed} failed, {len(EXAMPLES) - ran} skipped")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main())
