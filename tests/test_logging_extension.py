"""Triton's logging extension (`GET/POST /v2/logging`, gRPC `LogSettings`): settings round-trip over both
protocols, a refused change changes nothing, and a change takes effect at once in every process: the one
process, and with `--workers 2` the engine and each frontend (a POST reaches one frontend).

The answers and errors both servers share are conformance cases (conformance/cases/test_trace_logging.py).
"""

from __future__ import annotations

import re
import uuid

import grpc
import pytest
import requests
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from conftest import ROOT, start_server, stop_server, wait_for

MODELS = ROOT / "conformance" / "models"
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0, "log_format": "default"}
#: Fresh connections: with --workers 2 the kernel spreads them over both frontends (SO_REUSEPORT). The chance that
#: all of them reach the same one is 2**-(CONNECTIONS - 1).
CONNECTIONS = 24


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "workers_2"])
def served(request, tmp_path_factory):
    log = tmp_path_factory.mktemp("logging") / "server.log"
    server = start_server(MODELS, log, "--model_control_mode", "explicit", "--load_model", "simple", workers=request.param)
    yield server
    stop_server(server)


@pytest.fixture
def server(served):
    yield served
    requests.post(f"{served.url}/v2/logging", json={k: v for k, v in DEFAULTS.items() if k != "log_file"}).raise_for_status()


def post(server, settings) -> requests.Response:
    return requests.post(f"{server.url}/v2/logging", json=settings)


def grpc_settings(server, **settings) -> dict:
    value = pb.LogSettingsRequest.SettingValue
    with grpc.insecure_channel(server.grpc) as channel:
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).LogSettings(
            pb.LogSettingsRequest(settings={name: value(**v) for name, v in settings.items()})
        )
    return {name: getattr(v, v.WhichOneof("parameter_choice")) for name, v in answer.settings.items()}


def test_declared_and_round_trip(server):
    assert "logging" in requests.get(f"{server.url}/v2").json()["extensions"]
    assert requests.get(f"{server.url}/v2/logging").json() == DEFAULTS
    changed = {"log_info": False, "log_warning": False, "log_error": False, "log_verbose_level": 3, "log_format": "ISO8601"}
    assert post(server, changed).json() == {**DEFAULTS, **changed}
    assert grpc_settings(server) == {**DEFAULTS, **changed}  # what REST set, gRPC reads: one setting, server-wide
    back = grpc_settings(server, log_info={"bool_param": True}, log_verbose_level={"uint32_param": 0}, log_format={"string_param": "json"})
    assert back == {**DEFAULTS, **changed, "log_info": True, "log_verbose_level": 0, "log_format": "json"}
    assert requests.get(f"{server.url}/v2/logging").json() == back
    assert post(server, {"log_info": None, "log_file": None}).json() == back  # null: left as it is, as in Triton


#: Changes refused, with the status and the words of the answer; each names a valid change first, which must not apply.
REFUSED = {
    "wrong_type": ({"log_info": "yes"}, 400, "expect a boolean for 'log_info'"),
    "negative_verbose": ({"log_verbose_level": -1}, 400, "expect an unsigned integer for 'log_verbose_level'"),
    "unknown_format": ({"log_format": "xml"}, 400, "invalid argument for log_format, got: xml"),
    # Triton ignores a name it does not know; a misspelt setting (its own documentation's example says
    # "log_warnings") would be lost without a word, so this server names the settings instead.
    "unknown_setting": ({"log_warnings": False}, 400, "unknown log setting 'log_warnings'"),
    "log_file": ({"log_file": "/tmp/x.log"}, 501, "log file location can not be updated through network protocol"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_change_changes_nothing(server, case):
    change, status, words = REFUSED[case]
    answer = post(server, {"log_verbose_level": 1, **change})
    assert answer.status_code == status and words in answer.json()["error"], answer.text
    assert requests.get(f"{server.url}/v2/logging").json() == DEFAULTS


def test_grpc_refusals(server):
    with pytest.raises(grpc.RpcError) as raised:
        grpc_settings(server, log_info={"string_param": "x"})
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "log_info" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        grpc_settings(server, log_file={"string_param": ""})
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert grpc_settings(server) == DEFAULTS


def refused_requests(server, tag: str) -> None:
    """Requests every frontend refuses with an INFO line naming their id ("<tag>-<n>"), each on its own connection."""
    for n in range(CONNECTIONS):
        answer = requests.post(f"{server.url}/v2/models/simple/infer", json={}, headers={"x-request-id": f"{tag}-{n}", "Connection": "close"})
        assert answer.status_code == 400


def lines(server, pattern: str) -> list[str]:
    return [line for line in server.output().splitlines() if re.search(pattern, line)]


def test_levels_take_effect_in_every_process(server, request):
    tag = uuid.uuid4().hex[:8]
    # Verbose lines appear, in every frontend: each names the request it logs and its process.
    post(server, {"log_verbose_level": 1}).raise_for_status()
    refused_requests(server, f"verbose{tag}")
    verbose = wait_for(lambda: len(found := lines(server, f"DEBUG .*HTTP request: POST /v2/models/simple/infer .*verbose{tag}")) == CONNECTIONS and found, "verbose lines")
    frontends = {line.split()[2] for line in verbose}  # KServe's lines: date time pid logger ...
    assert len(frontends) == (2 if "workers_2" in request.node.callspec.id else 1), verbose
    # INFO off: the refusals' lines no longer appear in any frontend; WARNING and ERROR lines still would.
    post(server, {"log_verbose_level": 0, "log_info": False}).raise_for_status()
    refused_requests(server, f"quiet{tag}")
    post(server, {"log_info": True}).raise_for_status()
    refused_requests(server, f"loud{tag}")
    wait_for(lambda: len(lines(server, f"loud{tag}")) == CONNECTIONS, "INFO lines once back on")
    assert lines(server, f"quiet{tag}") == [] and lines(server, f"HTTP request: .*loud{tag}") == []


def test_info_off_in_the_engine(server):
    """A model's load is logged where the models are (the engine with --workers): off, then on again."""
    ready = "model 'identity_int8' is READY"
    load, unload = (f"{server.url}/v2/repository/models/identity_int8/{action}" for action in ("load", "unload"))
    post(server, {"log_info": False}).raise_for_status()
    requests.post(load).raise_for_status()
    requests.post(unload).raise_for_status()
    post(server, {"log_info": True}).raise_for_status()
    assert lines(server, ready) == []
    requests.post(load).raise_for_status()
    requests.post(unload).raise_for_status()
    wait_for(lambda: len(lines(server, ready)) == 1, "the load's line once INFO is back on")


def test_format_changes_in_every_process(server):
    tag = uuid.uuid4().hex[:8]
    post(server, {"log_format": "json"}).raise_for_status()
    refused_requests(server, f"json{tag}")
    found = wait_for(lambda: len(found := lines(server, f"json{tag}")) == CONNECTIONS and found, "JSON lines")
    assert all(line.startswith('{"time":') and '"level":"INFO"' in line for line in found), found
    post(server, {"log_format": "ISO8601"}).raise_for_status()
    refused_requests(server, f"iso{tag}")
    found = wait_for(lambda: len(found := lines(server, f"iso{tag}")) == CONNECTIONS and found, "ISO 8601 lines")
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \d+ ", line) for line in found), found


def test_log_format_flag_takes_the_settings_names():
    from kserve_ascend.server import cli

    assert cli.parse_args(["--log_format", "ISO8601"]).log_format == "ISO8601"
    assert cli.parse_args(["--log_format", "text"]).log_format == "default"  # its name before the logging extension
    with pytest.raises(SystemExit):
        cli.parse_args(["--log_format", "xml"])
