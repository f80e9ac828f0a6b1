"""Fixtures that start real server processes on free loopback ports, and what tests share besides.

Starting, stopping, waiting for, calling and scraping a server are the harness's
(conformance/harness.py, which the conformance suite uses too); they are re-exported here, so a
test imports its helpers from one place.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from conformance import harness
from conformance.harness import (  # noqa: F401  (re-exported for the tests)
    ROOT,
    Metrics,
    NotReady,
    Server,
    alive,
    command_line,
    descendants,
    executions_by_batch_size,
    free_port,
    infer,
    infer_one,
    json_body,
    pending,
    post_infer,
    scrape,
    start,
    start_server,
    start_triton,
    statistics,
    statistics_counts,
    stop_server,
    tensors,
    until,
    wait_for,
)

REPOSITORY = ROOT / "model_repository"
#: The FAKE pyACL module: on a server's PYTHONPATH it is imported as `acl`.
FAKE_ACL = ROOT / "tests" / "fake_acl"
#: The FAKE of the Ascend driver's DCMI library (C), compiled by `build_fake_dcmi`.
FAKE_DCMI = ROOT / "tests" / "fake_dcmi" / "dcmi.c"


def core_request(inputs: dict, rows: int = 1, priority: int | None = None, timeout_us: int | None = None):
    """A request as the core's schedulers take it (`contracts.Request`), for tests that drive a scheduler directly."""
    from kserve_ascend.core.contracts import Request, RequestOptions
    from kserve_ascend.core.stats import RequestTiming

    return Request(inputs, rows, (), RequestOptions({}, priority, timeout_us), RequestTiming())


def load_fake_acl():
    """A fresh copy of the FAKE pyACL module, loaded from its file under its own name
    (so `import acl` stays unresolvable in the test process)."""
    spec = importlib.util.spec_from_file_location("tests_fake_acl", FAKE_ACL / "acl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.FAKE
    return module


def fake_acl_env(faults: Path | None = None) -> dict[str, str]:
    """A server's environment additions that make it import the FAKE pyACL as `acl`, and (`faults`)
    read its fault-control file."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ACL), os.environ.get("PYTHONPATH")]))}
    if faults is not None:
        env["FAKE_ACL_FAULTS"] = str(faults)
    return env


def write_faults(path: Path, entries: list) -> None:
    """The FAKE pyACL's fault-control file (its env FAKE_ACL_FAULTS), written whole (a file renamed
    over it), as its docstring asks."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(entries))
    temporary.replace(path)


def build_fake_dcmi(directory: Path) -> Path:
    """The FAKE libdcmi.so compiled into `directory` with gcc (`make test` installs it, as for
    tests/cann_stubs); a server with `directory` on LD_LIBRARY_PATH loads it as the driver's."""
    library = directory / "libdcmi.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(FAKE_DCMI)], check=True, timeout=60)
    return library


def fake_dcmi_env(library: Path, state: Path) -> dict[str, str]:
    """A server's environment additions that make it load the FAKE libdcmi.so and read its machine from `state`."""
    path = os.pathsep.join(filter(None, [str(library.parent), os.environ.get("LD_LIBRARY_PATH")]))
    return {"LD_LIBRARY_PATH": path, "FAKE_DCMI_STATE": str(state)}


def write_dcmi_state(path: Path, npus: list[tuple[int, int, int, int, int, int]], errors: list[tuple[str, int, int, int]] = (),
                     holds: list[str] = ()) -> None:
    """The FAKE DCMI's machine (tests/fake_dcmi/dcmi.c): `npus` (card, device, logic ID, degrees Celsius,
    power in 0.1 W, health code), `errors` (call, card, device, code) and `holds` (calls that wait until
    the file no longer names them), written whole (a file renamed over it)."""
    lines = [f"npu {' '.join(map(str, npu))}" for npu in npus] + [f"error {' '.join(map(str, error))}" for error in errors]
    lines += [f"hold {call}" for call in holds]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(f"{line}\n" for line in lines))
    temporary.replace(path)


def start_on_fake_acl(repository: Path, name: str, *extra: str, **options) -> Server:
    """`start_server` on `repository` with the FAKE pyACL and an empty fault-control file, `server.faults`
    (for `write_faults`, `hold_executions`); its log and faults file are named `name` beside `repository`."""
    faults = repository.parent / f"{name}_faults.json"
    write_faults(faults, [])
    server = start_server(repository, repository.parent / f"{name}.log", *extra, env=fake_acl_env(faults), **options)
    server.faults = faults
    return server


def hold_executions(server: Server) -> None:
    """The next execution of a model on the FAKE pyACL blocks in its first device call
    (acl.rt.set_context) until `release_executions`; `server.faults` is its fault-control file."""
    write_faults(server.faults, [{"call": "acl.rt.set_context", "hang": True}])
    scrape(server)  # an ACL call (device utilization): the fake reads its file and arms the hang now


def release_executions(server: Server) -> None:
    """Ends the hang `hold_executions` armed: the held execution goes on, and the queue behind it."""
    write_faults(server.faults, [{"release": True}])
    scrape(server)  # an ACL call: the fake reads the release


def pytest_addoption(parser):
    parser.addoption(
        "--workers", type=int, default=1, metavar="N",
        help="start every kserve-ascend server with N frontend processes (--workers N) unless its test names a number",
    )


def pytest_configure(config):
    harness.DEFAULT_WORKERS = config.getoption("--workers")


#: Modules whose every test runs alone (marked `serial`: `make test` runs them after the others, one at a
#: time), and why: what they check depends on the machine's time or CPU, or loads it. Single tests of
#: the kind are marked in their own modules.
SERIAL = {
    "faults/test_loop.py": "times health probes (at most two of them 100 ms or more)",
    "faults/test_overload.py": "1,000 connections at once, RSS bounded; refusals from the queue's predicted wait",
    "faults/test_shutdown.py": "times the drain against --shutdown_timeout_s",
    "test_perf_analyzer.py": "perf_analyzer's load",
}


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests).as_posix() in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The KServe server on the project's own model_repository/."""
    srv = start_server(REPOSITORY, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    stop_server(srv)


def copy_model(name: str, repository: Path, new_name: str | None = None) -> Path:
    """Copies a model of model_repository/ into another repository (renaming it if asked)."""
    target = repository / (new_name or name)
    shutil.copytree(REPOSITORY / name, target)
    if new_name:
        config = target / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{name}"', f'name: "{new_name}"'))
    return target



def sim_model(
    repository: Path, name: str, max_batch_size: int, delay_us: int, fixed_ms: float, dims: int = 4,
    parameters: dict[str, str] | None = None,
) -> None:
    """A `sim` model (output = input) that batches up to `max_batch_size` rows, waiting up to `delay_us` for them;
    `parameters`: more config parameters (e.g. `sim_memory_mb`)."""
    copy_model("sim", repository, name)
    more = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in (parameters or {}).items())
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]\n'
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
        f'parameters {{ key: "sim_fixed_ms" value: {{ string_value: "{fixed_ms}" }} }}\n'
        'parameters { key: "sim_per_item_ms" value: { string_value: "0" } }\n' + more
    )


def sim_body(value: float) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}).encode()


def dashboard_row(panels: list[dict], title: str) -> list[dict]:
    """The panels of a Grafana dashboard's row `title` (its one row so named): those after it, up to the next row."""
    (row,) = [i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"] == title]
    rest = panels[row + 1:]
    return rest[:next((i for i, panel in enumerate(rest) if panel["type"] == "row"), len(rest))]


def both_servers(repository: Path, tmp_path_factory, *triton_args: str, wait_ready: bool = True, ours_args: tuple[str, ...] = ()):
    """For a module fixture (`yield from`): {"kserve-ascend": ..., "triton": ...} on one repository; `triton_args` and
    `ours_args` their flags."""
    ours = start_server(repository, tmp_path_factory.mktemp("logs") / "server.log", *ours_args, wait="ready" if wait_ready else "loaded")
    try:
        triton = start_triton(repository, tmp_path_factory.mktemp("triton"), *triton_args, wait_ready=wait_ready)
    except BaseException:
        stop_server(ours)
        raise
    try:
        yield {"kserve-ascend": ours, "triton": triton}
    finally:
        stop_server(triton)
        stop_server(ours)


def decoupled_repository(repository: Path) -> Path:
    """`repeat_int32` (decoupled) and `simple` beside it, as the tests of decoupled models serve them."""
    copy_model("repeat_int32", repository)
    copy_model("simple", repository)
    return repository


def every_server(repository: Path, tmp_path_factory):
    """For a module fixture (`yield from`): {"kserve-ascend": ..., "workers": (--workers 2) ..., "triton": ...} on one
    repository."""
    logs = tmp_path_factory.mktemp("logs")
    started = {}
    try:
        started["kserve-ascend"] = start_server(repository, logs / "server.log", workers=1)
        started["workers"] = start_server(repository, logs / "workers.log", workers=2)
        started["triton"] = start_triton(repository, tmp_path_factory.mktemp("triton"))
        yield started
    finally:
        for server in started.values():
            stop_server(server)


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> Server:
    """Real Triton 2.51 on the project's own model_repository/."""
    srv = start_triton(REPOSITORY, tmp_path_factory.mktemp("triton"))
    yield srv
    stop_server(srv)


# ---------------------------------------------------------------- OpenTelemetry traces


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps what it is sent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.services: set[str] = set()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                self.services.add(attributes.get("service.name"))
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.name == name]

    def clear(self) -> None:
        with self.lock:
            self.spans.clear()
            self.services.clear()


@pytest.fixture(scope="module")
def collector():
    """A `Collector` on a free loopback port (`.endpoint`), for a server's OTLP exporter (see `otel_env`)."""
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    yield receiver
    server.stop(None)


def otel_env(collector: Collector) -> dict[str, str]:
    """A server's environment additions that export its spans to `collector`, batched every 100 ms."""
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def attributes(span: Span) -> dict:
    """A span's attributes by key, each value as its type (string, int...)."""

    def value(any_value):
        return getattr(any_value, any_value.WhichOneof("value"))

    return {a.key: value(a.value) for a in span.attributes}
