"""Triton's trace extension (`/v2[/models/{m}]/trace/setting`, gRPC `TraceSetting`) with `trace_mode triton`: the
same settings and requests to real Triton 2.51 and to kserve-ascend (one process and --workers 2), whose trace
files one reader parses alike: the requests traced (rate, count, a model's own setting, a null clearing it), each
trace's entries (Triton's timestamp names for HTTP and gRPC, its tensors at level TENSORS), files split by
log_frequency. And with `trace_mode opentelemetry`, the level switching the spans on and off in every process.

The answers and errors both servers share are conformance cases (conformance/cases/test_trace_logging.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import triton_to_np_dtype

from conftest import ROOT, otel_env, start_server, start_triton, stop_server, wait_for

MODELS = ROOT / "conformance" / "models"
#: Triton's timestamps of a request, by the protocol it came by (as Triton 2.51 writes them).
CORE = {"REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
        "INFER_RESPONSE_COMPLETE", "REQUEST_END"}  # fmt: skip
TIMESTAMPS = {
    "HTTP": CORE | {"HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END"},
    "GRPC": CORE | {"GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END"},
}
#: In this order on one clock (Triton's trace_summary.py subtracts them so).
ORDER = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


def read_traces(directory: Path, files: str = "trace.json*") -> dict[str, dict]:
    """Every trace in `files` (`trace.json` and `trace.json.<n>`), by request id, grouped by trace id as Triton's
    trace_summary.py groups them: model, version, {timestamp name: ns}, tensors, and the file it is in."""
    by_id: dict[int, dict] = {}
    for path in sorted(directory.glob(files)):
        for entry in json.loads(path.read_text()):
            trace = by_id.setdefault(entry["id"], {"timestamps": {}, "tensors": [], "file": path.name})
            if "timestamps" in entry:
                (stamp,) = entry["timestamps"]
                trace["timestamps"][stamp["name"]] = stamp["ns"]
            elif "activity" in entry:
                trace["tensors"].append((entry["activity"], entry["tensor"]))
            else:
                trace.update(model=(entry["model_name"], entry["model_version"]), request_id=entry.get("request_id", ""))
    # At level TENSORS alone a trace is its tensors only: no request id to name it by.
    return {trace.get("request_id", f"#{id}"): trace for id, trace in by_id.items()}


def settings_of(server, model: str = "", **changes) -> dict:
    path = f"/v2/models/{model}/trace/setting" if model else "/v2/trace/setting"
    answer = requests.post(server.url + path, json=changes) if changes else requests.get(server.url + path)
    assert answer.status_code == 200, answer.text
    settings = answer.json()
    if "trace_file" in settings:  # triton mode: the same file name, in each server's own directory
        settings["trace_file"] = Path(settings["trace_file"]).name
    return settings


def simple_requests(server, protocol: str, ids: list[str], model: str = "simple") -> None:
    module = httpclient if protocol == "HTTP" else grpcclient
    with module.InferenceServerClient(server.http if protocol == "HTTP" else server.grpc) as client:
        for request_id in ids:
            names = ("INPUT0", "INPUT1") if model == "simple" else ("INPUT0",)
            inputs = [module.InferInput(name, [1, 16], "INT32") for name in names]
            for tensor in inputs:
                tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            client.infer(model, inputs, request_id=request_id)


def scenario(server, directory: Path) -> list[dict]:
    """The same settings and requests, to either server; the setting answered after each step."""
    answers = [settings_of(server)]
    # log_frequency 2 (from the flags): two traces a file.
    simple_requests(server, "HTTP", ["p1-http-0", "p1-http-1"])
    simple_requests(server, "GRPC", ["p1-grpc-0", "p1-grpc-1"])
    wait_for(lambda: len(list(directory.glob("trace.json.*"))) == 2, "two trace files of two traces", server=server)
    # Every third request, two of them.
    answers.append(settings_of(server, trace_rate="3", trace_count="2", log_frequency="0"))
    simple_requests(server, "HTTP", [f"p2-{n}" for n in range(9)])
    answers.append(settings_of(server))  # the count is spent
    # A model's own setting: off for `simple`, tensors for `identity_int32`; then `simple` back to the global one.
    answers.append(settings_of(server, trace_rate="1", trace_count="-1"))
    answers.append(settings_of(server, "simple", trace_level=["OFF"]))
    answers.append(settings_of(server, "identity_int32", trace_level=["TIMESTAMPS", "TENSORS"], trace_count="1"))
    answers.append(settings_of(server, "simple"))
    simple_requests(server, "HTTP", ["p3-simple-off"])
    simple_requests(server, "GRPC", ["p3-identity-0", "p3-identity-1"], "identity_int32")
    answers.append(settings_of(server, "simple", trace_level=None))
    simple_requests(server, "HTTP", ["p3-simple-on"])
    answers.append(settings_of(server, "simple"))
    # Tensors alone, of each kind of value (Triton's tracer.cc formats them as C++ streams them). First
    # identity_int32's own setting goes: Triton 2.51 refuses every global change while a model's count is spent
    # ("Attempting to set invalid trace setting :").
    answers.append(settings_of(server, "identity_int32", trace_level=None, trace_count=None))
    answers.append(settings_of(server, trace_level=["TENSORS"]))
    for model, datatype, values in TENSORS:
        with httpclient.InferenceServerClient(server.http) as client:
            tensor = httpclient.InferInput("INPUT0", [1, len(values)], datatype)
            tensor.set_data_from_numpy(np.array([values], dtype=triton_to_np_dtype(datatype)))
            client.infer(model, [tensor])
    return answers


TENSORS = [
    ("identity_fp32", "FP32", [1 / 3, -2.5, 1e20, 0.1]),
    ("identity_bool", "BOOL", [True, False]),
    ("identity_bytes", "BYTES", [b"kserve", b"ascend"]),
    ("identity_int32", "INT32", [-7, 0, 2**31 - 1]),
]


TRACED = {"p1-http-0", "p1-http-1", "p1-grpc-0", "p1-grpc-1", "p2-2", "p2-5", "p3-identity-0", "p3-simple-on"}
FLAGS = ("level=TIMESTAMPS", "rate=1", "triton,log-frequency=2")
LOADED = ("simple", "identity_int32", "identity_fp32", "identity_bool", "identity_bytes")


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory):
    """The scenario on real Triton 2.51: its answers and the traces it wrote (read once it stopped)."""
    directory = tmp_path_factory.mktemp("triton-traces")
    flags = [f"--trace-config=triton,file={directory / 'trace.json'}", *(f"--trace-config={flag}" for flag in FLAGS)]
    server = start_triton(MODELS, tmp_path_factory.mktemp("triton"), "--model-control-mode=explicit",
                          *(f"--load-model={model}" for model in LOADED), *flags)  # fmt: skip
    try:
        answers = scenario(server, directory)
    finally:
        stop_server(server)
    return answers, read_traces(directory), directory


@pytest.mark.parametrize("workers", [1, 2], ids=["one_process", "workers_2"])
def test_traces_as_triton_writes_them(triton_run, tmp_path, workers):
    triton_answers, triton_traces, triton_directory = triton_run
    directory = tmp_path / "traces"
    directory.mkdir()
    flags = [f"--trace_config=triton,file={directory / 'trace.json'}", *(f"--trace_config={flag}" for flag in FLAGS)]
    server = start_server(MODELS, tmp_path / "server.log", "--model_control_mode", "explicit",
                          *(f"--load_model={model}" for model in LOADED), *flags, workers=workers)  # fmt: skip
    try:
        assert "trace" in requests.get(f"{server.url}/v2").json()["extensions"]
        answers = scenario(server, directory)
        # The files log_frequency wrote hold two traces each, on both servers.
        for traces in (read_traces(directory, "trace.json.[01]"), triton_traces):
            assert sorted(t["request_id"] for t in traces.values() if t["file"] == "trace.json.0") == ["p1-http-0", "p1-http-1"]
            assert sorted(t["request_id"] for t in traces.values() if t["file"] == "trace.json.1") == ["p1-grpc-0", "p1-grpc-1"]
    finally:
        stop_server(server)  # `trace.json` is complete once the server stopped
    assert answers == triton_answers
    traces = read_traces(directory)
    tensors_only = {key: trace["tensors"] for key, trace in traces.items() if key.startswith("#")}
    assert tensors_only == {key: trace["tensors"] for key, trace in triton_traces.items() if key.startswith("#")}
    assert sorted(tensor["dtype"] for trace in tensors_only.values() for _, tensor in trace) == sorted(
        [datatype for _, datatype, _ in TENSORS] * 2
    )
    traces = {key: trace for key, trace in traces.items() if key not in tensors_only}
    assert set(traces) == {key for key in triton_traces if not key.startswith("#")} == TRACED
    for request_id, trace in traces.items():
        theirs = triton_traces[request_id]
        protocol = "GRPC" if "grpc" in request_id or "identity" in request_id else "HTTP"
        assert set(trace["timestamps"]) == set(theirs["timestamps"]) == TIMESTAMPS[protocol], request_id
        assert trace["model"] == theirs["model"]
        stamps = trace["timestamps"]
        assert [stamps[name] for name in ORDER] == sorted(stamps[name] for name in ORDER), request_id
        assert stamps["COMPUTE_END"] <= stamps["INFER_RESPONSE_COMPLETE"] <= stamps["REQUEST_END"]
        assert trace["tensors"] == theirs["tensors"], request_id  # TENSORS: the inputs queued, the outputs made
    assert traces["p3-identity-0"]["tensors"][0][0] == "TENSOR_QUEUE_INPUT"
    assert sorted(p.name for p in triton_directory.glob("trace.json*")) >= ["trace.json", "trace.json.0", "trace.json.1"]


def test_tracing_off_writes_nothing(tmp_path):
    """No setting traces by default: no file; with the level on but no file, Triton's refusal."""
    server = start_server(MODELS, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "simple",
                          "--trace_config", f"triton,file={tmp_path / 'trace.json'}")  # fmt: skip
    try:
        assert settings_of(server)["trace_level"] == ["OFF"]
        simple_requests(server, "HTTP", ["off-0", "off-1"])
    finally:
        stop_server(server)
    assert list(tmp_path.glob("trace.json*")) == []


def fresh_connections(server, ids: list[str]) -> None:
    """A request each, on a connection of its own: with --workers 2 the kernel spreads them over both frontends."""
    body = {"inputs": [{"name": f"INPUT{n}", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for n in (0, 1)]}
    for request_id in ids:
        answer = requests.post(f"{server.url}/v2/models/simple/infer", json={**body, "id": request_id}, headers={"Connection": "close"})
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("workers", [1, 2], ids=["one_process", "workers_2"])
def test_opentelemetry_level_switches_spans_in_every_process(tmp_path, collector, workers):
    collector.clear()
    server = start_server(MODELS, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "simple",
                          "--trace_config", "mode=opentelemetry", env=otel_env(collector), workers=workers)  # fmt: skip
    lit = [f"lit-{n}" for n in range(16)]
    try:
        assert settings_of(server) == {"trace_level": ["OFF"], "trace_rate": "1", "trace_count": "-1", "trace_mode": "opentelemetry"}
        fresh_connections(server, [f"dark-{n}" for n in range(16)])
        settings_of(server, trace_level=["TIMESTAMPS"])
        fresh_connections(server, lit)
        wait_for(lambda: len(collector.named("infer")) >= len(lit) and collector.named("execute"), "spans", server=server)
        refused = requests.post(f"{server.url}/v2/trace/setting", json={"trace_rate": "10"})
        assert refused.status_code == 400 and "OTEL_TRACES_SAMPLER" in refused.json()["error"]
        settings_of(server, trace_level=["OFF"])
        fresh_connections(server, [f"dark-again-{n}" for n in range(16)])
    finally:
        stop_server(server)  # flushes the spans left
    ids = sorted(a.value.string_value for span in collector.named("infer") for a in span.attributes if a.key == "request.id")
    assert ids == sorted(lit)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["file=/tmp/t.json"], "triton,file=/tmp/t.json is how it is given"),  # Triton's scoping of the file's settings
        (["triton,rate=1"], "rate=1 is how it is given"),
        (["level=TIMESTAMPS"], "trace file name is not given"),
        (["triton,file=/tmp/t.json", "level=TIMESTAMPS", "rate=0"], "sample rate must be non-zero"),
        (["level=LOUD"], "unknown trace level 'LOUD'"),
        (["mode=opentelemetry", "rate=10"], "OTEL_TRACES_SAMPLER"),
    ],
    ids=["unscoped_file", "scoped_rate", "no_file", "rate_zero", "unknown_level", "otel_rate"],
)
def test_trace_config_refused_at_start(flags, words, capsys):
    from kserve_ascend.server import cli

    with pytest.raises(SystemExit):
        cli.parse_args([arg for flag in flags for arg in ("--trace_config", flag)])
    assert words in capsys.readouterr().err


def test_trace_config_read_as_triton_reads_it():
    from kserve_ascend.server.observability import traces

    manager = traces.manager_of(["triton,file=/tmp/t.json", "level=TIMESTAMPS", "level=TENSORS", "rate=7", "count=3",
                                 "triton,log-frequency=5"])  # fmt: skip
    assert manager.answer() == {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "7", "trace_count": "3",
                                "log_frequency": "5", "trace_file": "/tmp/t.json", "trace_mode": "triton"}  # fmt: skip
    assert traces.manager_of([], enable_tracing=True).answer() == {
        "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1", "trace_mode": "opentelemetry"
    }


def test_a_models_spent_count_stays_spent_when_the_global_setting_changes(tmp_path):
    """As Triton keeps a model's count as it is now (tracer.cc: the current setting's value of a field given for the
    model); Triton 2.51 then refuses the global change itself, an error this server does not copy."""
    from kserve_ascend.server.observability import traces

    manager = traces.manager_of([f"triton,file={tmp_path / 'trace.json'}", "level=TIMESTAMPS", "rate=1"])
    manager.update("simple", {"trace_count": "1"})
    assert manager.sample("simple", "a", "HTTP") is not None and manager.sample("simple", "b", "HTTP") is None
    manager.update("", {"trace_rate": "2"})
    assert manager.answer("simple")["trace_count"] == "0"
    assert manager.answer("simple")["trace_rate"] == "2"  # not given for the model: the global one
    assert manager.update("simple", {"trace_count": None})["trace_count"] == "-1"


def test_an_http_trace_of_a_request_never_queued_writes_its_tensors_after_the_send(tmp_path):
    """Triton's order whatever is present: a request refused before it was queued has no QUEUE_START, and at level
    TENSORS its first tensor once took that place, before HTTP_SEND_START."""
    from kserve_ascend.core.stats import RequestTiming
    from kserve_ascend.server.observability import traces

    manager = traces.manager_of([f"triton,file={tmp_path / 'trace.json'}", "level=TIMESTAMPS", "level=TENSORS", "rate=1"])
    trace = manager.sample("simple", "a", "HTTP")
    trace.inputs(1, {"INPUT0": np.zeros((1, 4), np.float32)})
    entries = trace._entries(RequestTiming(start=100), 200)
    names = [e["timestamps"][0]["name"] if "timestamps" in e else e.get("activity", "info") for e in entries]
    assert names == ["HTTP_RECV_START", "HTTP_RECV_END", "info", "REQUEST_START", "HTTP_SEND_START", "HTTP_SEND_END",
                     "TENSOR_QUEUE_INPUT", "REQUEST_END"]  # fmt: skip
