"""Start, stop, wait for, call and scrape an OIP server: written once, for tests/ and conformance/.

tests/ starts kserve-ascend and real Triton with it (tests/conftest.py re-exports it beside the
fixtures); `python -m conformance --serve` starts the server it checks with it (conformance/serve.py).
It imports neither tests/ nor the suite's cases (which take from it only what runs against any server,
as `python -m conformance --http HOST:PORT --grpc HOST:PORT` does: waiting).

A target is anything with `.http` and `.grpc` (HOST:PORT) and `.url` (http://HOST:PORT): a
`Server` started here, or the suite's `Target`.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

ROOT = Path(__file__).resolve().parent.parent
#: Loading a repository takes seconds; Triton starts a Python stub per model instance first.
READY_TIMEOUT_S = 60
TRITON_READY_TIMEOUT_S = 120
#: Above kserve-ascend's default --shutdown_timeout_s (20 s), in which it drains in-flight requests.
STOP_TIMEOUT_S = 30
#: What `start_server` starts when its caller names no number of frontends (`pytest --workers N` sets it).
DEFAULT_WORKERS = 1
#: The response cache (bytes) the suite's servers run with: conformance/cases/test_cache.py relies on it.
CACHE_SIZE = 1_048_576


# ---------------------------------------------------------------- processes


@dataclass
class Server:
    """A server process and its loopback ports; its output goes to `log`."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    metrics_port: int = 0
    name: str = "server"

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


#: A lock file per port handed out (see free_port); the last HELD_PORTS stay locked.
PORT_LOCKS = Path(tempfile.gettempdir()) / "kserve-ascend-test-ports"
HELD_PORTS = 64
_held_ports: collections.deque = collections.deque()


def free_port() -> int:
    """A loopback port free now that no other process using this harness holds, nor this one before.

    The kernel may give the same free port twice in a row, and another process (a pytest-xdist worker,
    another test run) may be given it before the server it was meant for binds it: each port handed out
    is reserved by an exclusive lock on a file of its own (flock; it ends with the process), until
    HELD_PORTS more have been handed out here (its server bound it long since, or failed).
    """
    PORT_LOCKS.mkdir(exist_ok=True)
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        lock = open(PORT_LOCKS / str(port), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()  # handed out already, here or elsewhere
            continue
        _held_ports.append(lock)
        if len(_held_ports) > HELD_PORTS:
            _held_ports.popleft().close()
        return port


class NotReady(AssertionError):
    """What `wait_for` raises: the condition did not hold in time, or the server exited (then the
    message ends with its log's tail)."""


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30, server: Server | None = None):
    """Polls `condition` until it returns something true, and returns that.

    Fails (NotReady, naming `what`) after `timeout` seconds, or as soon as `server` (if given) exits;
    then `server` is stopped, and the message ends with its log. A refused connection counts as "not
    yet" (a server still starting).
    """
    deadline = time.monotonic() + timeout
    refused = None
    while True:
        if server is not None and server.process.poll() is not None:
            failure = f"{server.name} exited with {server.process.returncode}"
            break
        try:
            if value := condition():
                return value
        except requests.ConnectionError as error:
            refused = error
        if time.monotonic() > deadline:
            failure = f"not within {timeout} s"
            break
        time.sleep(0.02)
    if server is None:
        raise NotReady(f"waiting for {what}: {failure}") from refused
    stop_server(server, check=False)
    raise NotReady(f"waiting for {what}: {failure}; the end of {server.log}:\n{server.tail()}") from refused


async def until(condition: Callable[[], object], what: str, timeout: float = 10) -> None:
    """`wait_for` on an event loop, for state in this process (a scheduler's queue): polls without
    blocking the loop, so what it waits for goes on meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise NotReady(f"waiting for {what}: not within {timeout} s")
        await asyncio.sleep(0.001)


def start(
    command: list[str], log: Path, http_port: int, grpc_port: int = 0, metrics_port: int = 0, *,
    name: str = "server", ready: str | Callable[[Server], bool] = "/v2/health/ready",
    timeout: float = READY_TIMEOUT_S, env: Mapping[str, str] | None = None, cwd: Path = ROOT,
) -> Server:
    """Runs `command` (output to `log`, `env` added to this process's) and waits until it is `ready`: a
    path its HTTP port answers 200, or a condition of the server (see wait_for)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})})
    server = Server(process, http_port, grpc_port, log, metrics_port, name)

    def is_ready() -> bool:
        return ready(server) if callable(ready) else requests.get(server.url + ready, timeout=1).status_code == 200

    wait_for(is_ready, f"{name} to be ready", timeout, server)
    return server


def start_server(
    model_dir: Path | str, log: Path, *extra: str, env: Mapping[str, str] | None = None,
    wait: str | Callable[[Server], bool] = "ready", workers: int | None = None, timeout: float = READY_TIMEOUT_S,
) -> Server:
    """`python -m kserve_ascend` on free ports, once it is `wait`: "ready", "loaded" (the start-up load
    has ended, a broken model's reason is in the index), "live", or a condition of the server.
    `workers` > 1: an engine and that many frontend processes (`--workers`); by default DEFAULT_WORKERS."""
    workers = DEFAULT_WORKERS if workers is None else workers
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [
        sys.executable, "-m", "kserve_ascend", "--model_dir", str(model_dir),
        "--http_port", str(http_port), "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port),
        *(("--workers", str(workers)) if workers > 1 else ()),
        *extra,
    ]  # fmt: skip

    def loaded(server: Server) -> bool:
        index = requests.post(f"{server.url}/v2/repository/index", timeout=1).json()
        return all(entry["state"] != "LOADING" for entry in index)

    ready = loaded if wait == "loaded" else wait if callable(wait) else f"/v2/health/{wait}"
    return start(command, log, http_port, grpc_port, metrics_port, name="kserve-ascend", ready=ready, timeout=timeout, env=env)


def start_triton(
    model_dir: Path, workdir: Path, *extra: str, wait_ready: bool = True, timeout: float = TRITON_READY_TIMEOUT_S
) -> Server:
    """Real Triton 2.51 with the `ascend` backend (tools/run_triton.py) on free ports; its log and
    backend directory in `workdir`. Ready, or (`wait_ready=False`) live."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [
        sys.executable, str(ROOT / "tools" / "run_triton.py"),
        "--model-repository", str(model_dir), "--backend-directory", str(workdir / "backends"),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
        "--", *extra,
    ]  # fmt: skip
    ready = "/v2/health/ready" if wait_ready else "/v2/health/live"
    return start(command, workdir / "triton.log", http_port, grpc_port, metrics_port, name="triton", ready=ready, timeout=timeout)


def stop_server(server: Server, check: bool = True) -> None:
    """SIGTERM, as Kubernetes stops a pod (SIGKILL only if it hangs); then every process the server
    started must be gone too (frontends of --workers, codec processes, Triton's stubs), or, with
    `check`, the test fails naming them."""
    started = descendants(server.process.pid)
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"{server.name} did not stop within {STOP_TIMEOUT_S} s of SIGTERM: killed", file=sys.stderr)
        server.process.kill()
        server.process.wait()
    deadline = time.monotonic() + 10
    while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    named = [command_line(pid) for pid in left]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not (check and left), f"{server.name} left processes behind: {named}"


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and the ones they started (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"pid {pid} (gone)"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which only its new parent has yet to reap, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------- calling


def json_body(inputs: Mapping[str, np.ndarray], **fields) -> dict:
    """An OIP JSON inference request of numpy arrays (BYTES as text), plus any other fields
    (`outputs`, `parameters`, `id`)."""
    tensors = []
    for name, array in inputs.items():
        array = np.asarray(array)
        data = [x.decode() if isinstance(x, bytes) else x for x in array.ravel().tolist()]
        tensors.append({"name": name, "shape": list(array.shape), "datatype": np_to_triton_dtype(array.dtype), "data": data})
    return {"inputs": tensors, **fields}


def post_infer(target, model: str, body: dict | bytes, version: str = "", timeout: float = 30, session=requests, **kwargs) -> requests.Response:
    """POST /v2/models/MODEL[/versions/V]/infer: a JSON body (dict) or bytes as they are."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    payload = {"data": body} if isinstance(body, bytes) else {"json": body}
    return session.post(target.url + path, timeout=timeout, **payload, **kwargs)


def tensors(module, inputs: Mapping[str, np.ndarray], binary_data: bool = True) -> list:
    """tritonclient InferInputs (of `module`: tritonclient.http or .grpc) of numpy arrays."""
    result = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        if module is httpclient:
            tensor.set_data_from_numpy(array, binary_data=binary_data)
        else:
            tensor.set_data_from_numpy(array)
        result.append(tensor)
    return result


def infer(
    target, model: str, inputs: Mapping[str, np.ndarray], protocol: str = "http",
    outputs: Iterable[str] | Mapping[str, dict] | None = None, binary_data: bool = True, **options,
) -> dict[str, np.ndarray]:
    """One inference with tritonclient over "http" or "grpc": every output answered, by name.

    `outputs`: the names to request, or names with InferRequestedOutput's options (`class_count`);
    `options`: client.infer's (`model_version`, `request_id`, `parameters`, `priority`, `timeout`...).
    A refusal raises tritonclient's InferenceServerException.
    """
    module = httpclient if protocol == "http" else grpcclient
    wanted = None
    if outputs is not None:
        outputs = outputs if isinstance(outputs, Mapping) else {name: {} for name in outputs}
        extra = {"binary_data": binary_data} if module is httpclient else {}
        wanted = [module.InferRequestedOutput(name, **extra, **kwargs) for name, kwargs in outputs.items()]
    with module.InferenceServerClient(target.http if module is httpclient else target.grpc) as client:
        result = client.infer(model, tensors(module, inputs, binary_data), outputs=wanted, **options)
    answered = result.get_response(as_json=True)["outputs"] if module is grpcclient else result.get_response()["outputs"]
    return {output["name"]: result.as_numpy(output["name"]) for output in answered}


def infer_one(target, model: str, array: np.ndarray, protocol: str = "http", name: str = "INPUT0") -> np.ndarray:
    """The one output of a model with one input, `name`, sent `array` over "http" or "grpc" (see infer)."""
    (answer,) = infer(target, model, {name: array}, protocol).values()
    return answer


def grpc_request(model: str, inputs: Mapping[str, np.ndarray], id: str = "", outputs: Iterable[str] = (), **parameters) -> pb.ModelInferRequest:
    """A gRPC ModelInferRequest of numpy arrays (raw contents); `parameters` as bool, int or string params."""
    request = pb.ModelInferRequest(model_name=model, id=id)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in parameters.items():
        kind = "bool_param" if isinstance(value, bool) else "int64_param" if isinstance(value, int) else "string_param"
        setattr(request.parameters[key], kind, value)
    return request


def repeat_request(values, delays=None, wait: int = 0, **options) -> pb.ModelInferRequest:
    """A gRPC ModelInferRequest of `repeat_int32` (Triton's repeat backend: a response per element of `values`,
    the model waiting `delays` ms, by default 0, before each); `options` as grpc_request's (id, outputs, parameters)."""
    values = np.asarray(values, np.int32)
    delays = np.zeros(values.shape, np.uint32) if delays is None else np.asarray(delays, np.uint32)
    inputs = {"IN": values, "DELAY": delays, "WAIT": np.array([wait], np.uint32)}
    return grpc_request("repeat_int32", inputs, **options)


def stream_infer(target, requests: Iterable[pb.ModelInferRequest], timeout: float = 30) -> list[pb.ModelStreamInferResponse]:
    """Every response of one gRPC ModelStreamInfer call sending `requests`, as sent (parameters and errors
    included), until the server ends the stream (once it has answered every request)."""
    with grpc.insecure_channel(target.grpc) as channel:
        return list(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=timeout))


def response_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """A gRPC response's outputs (raw contents) by name."""
    return {
        output.name: np.frombuffer(raw, triton_to_np_dtype(output.datatype)).reshape(list(output.shape))
        for output, raw in zip(response.outputs, response.raw_output_contents)
    }


# ---------------------------------------------------------------- scraping


class Metrics:
    """One /metrics answer, parsed with prometheus_client's parser, as Prometheus reads it.

    A sample is asked for by its name as exposed; a counter's also by its family's name (the parser
    names Triton's counter samples `<family>_total`).
    """

    def __init__(self, text: str):
        self.text = text
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = [sample for family in self.families.values() for sample in family.samples]

    def _matching(self, name: str, labels: Mapping[str, str]) -> list:
        names = (name, f"{name}_total")
        return [s for s in self.samples if s.name in names and labels.items() <= s.labels.items()]

    def values(self, name: str, **labels: str) -> list[float]:
        """The values of every sample of `name` whose labels include `labels`."""
        return [s.value for s in self._matching(name, labels)]

    def __call__(self, name: str, **labels: str) -> float:
        """The value of the one sample of `name` whose labels include `labels`."""
        values = self.values(name, **labels)
        assert len(values) == 1, f"{len(values)} samples {name}{labels}"
        return values[0]

    def by(self, label: str, name: str, **labels: str) -> dict[str, float]:
        """The samples of `name` whose labels include `labels`, by the value of `label` (e.g. by device)."""
        return {s.labels[label]: s.value for s in self._matching(name, labels)}

    def buckets(self, name: str, **labels: str) -> dict[float, float]:
        """A histogram's cumulative buckets: upper bound -> count."""
        return {float(le): value for le, value in self.by("le", f"{name}_bucket", **labels).items()}


def scrape(target, port: int | None = None) -> Metrics:
    """/metrics of `port`: by default the server's --metrics_port, else its HTTP port."""
    port = port or getattr(target, "metrics_port", 0) or target.http.rsplit(":", 1)[1]
    return Metrics(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def pending(target, model: str) -> float:
    """The model's requests waiting in its queue (not those executing), as its metrics say (Triton's name)."""
    return scrape(target)("nv_inference_pending_request_count", model=model)


def statistics(target, model: str, version: str = "") -> dict:
    """The statistics extension's entry of the model (of `version`, or its only one)."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/stats"
    answer = requests.get(target.url + path, timeout=10)
    assert answer.status_code == 200, answer.text
    (entry,) = answer.json()["model_stats"]
    return entry


def statistics_counts(target, model: str) -> dict[str, int]:
    """The model's statistics as counts: every inference_stats field, inference_count and execution_count."""
    stats = statistics(target, model)
    flat = {key: value["count"] for key, value in stats["inference_stats"].items()}
    return flat | {"inference_count": stats["inference_count"], "execution_count": stats["execution_count"]}


def executions_by_batch_size(stats: dict) -> dict[int, int]:
    """How many executions ran each batch size (the statistics' batch_stats)."""
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
