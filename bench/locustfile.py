"""Locust load for an Open Inference Protocol v2 server (kserve-ascend, Triton, MLServer, KServe): JSON infer.

    .venv/bin/locust -f bench/locustfile.py --host http://localhost:8080 --headless -u 16 -r 16 -t 60s
    .venv/bin/locust -f bench/locustfile.py --host http://localhost:8080 --tags simple   # one model; web UI on :8089

Each user sends its next request as soon as the last is answered (closed loop, as hey and
perf_analyzer do), so `-u` is the concurrency. Tasks, one per model (select with --tags):
`simple` (two INT32 [1,16]; model_repository/) and `fastsim` (FP32 [1,4], the fast simulated
device; bench/model_repository/, so `make serve MODEL_DIR=bench/model_repository` serves it).
A response counts as a failure unless it is 200 with the model's outputs.
"""

from __future__ import annotations

from locust import FastHttpUser, constant, tag, task

#: The bodies a user would POST: one row per request, as bench/payloads.py sends them.
BODIES = {
    "simple": {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]},
    "fastsim": {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [0.5, 1.5, 2.5, 3.5]}]},
}
OUTPUTS = {"simple": {"OUTPUT0", "OUTPUT1"}, "fastsim": {"OUTPUT0"}}


class InferUser(FastHttpUser):
    wait_time = constant(0)

    def infer(self, model: str) -> None:
        path = f"/v2/models/{model}/infer"
        with self.client.post(path, json=BODIES[model], name=path, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            outputs = {output.get("name") for output in (response.json() or {}).get("outputs", [])}
            if outputs != OUTPUTS[model]:
                response.failure(f"outputs {sorted(outputs)}, expected {sorted(OUTPUTS[model])}")

    @tag("simple")
    @task
    def simple(self) -> None:
        self.infer("simple")

    @tag("fastsim")
    @task
    def fastsim(self) -> None:
        self.infer("fastsim")
