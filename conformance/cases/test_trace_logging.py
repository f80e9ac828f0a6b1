"""Triton's logging and trace extensions (extension_logging.md, extension_trace.md): the settings each answers,
changes over REST and gRPC (through tritonclient, as Triton's users make them), and their refusals.

The suite's server is shared by every case: a case that changes a setting puts it back.
"""

import grpc as grpc_module
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

LOG_SETTINGS = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int, "log_format": str}
LOG_DEFAULTS = {"log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0, "log_format": "default"}


@pytest.fixture
def log_settings_restored(url):
    yield
    requests.post(f"{url}/v2/logging", json=LOG_DEFAULTS).raise_for_status()


@pytest.mark.spec("Triton extension_logging.md §Log Setting Response JSON Object")
def test_log_settings_answered(url, grpc, requires):
    requires("logging")
    answer = requests.get(f"{url}/v2/logging")
    assert answer.status_code == 200, answer.text
    settings = answer.json()
    assert {name: type(value) for name, value in settings.items()} == LOG_SETTINGS
    assert settings == {"log_file": "", **LOG_DEFAULTS}  # as both servers start in the suite
    over_grpc = grpc.get_log_settings(as_json=True)["settings"]
    assert {name: next(iter(value.values())) for name, value in over_grpc.items()} == settings


@pytest.mark.spec("Triton extension_logging.md §Log Setting Request JSON Object: only the specified settings are updated")
def test_log_settings_changed_over_rest_read_over_grpc(url, http, grpc, requires, log_settings_restored):
    requires("logging")
    changed = {"log_info": False, "log_verbose_level": 1, "log_format": "ISO8601"}
    answer = http.update_log_settings(changed)
    assert answer == {"log_file": "", **LOG_DEFAULTS, **changed}
    assert http.get_log_settings() == answer
    grpc.update_log_settings({"log_warning": False, "log_verbose_level": 0})
    assert http.get_log_settings() == {**answer, "log_warning": False, "log_verbose_level": 0}


@pytest.mark.spec("Triton extension_logging.md: 'log_file' cannot be updated (Triton: UNSUPPORTED, 501)")
def test_log_file_change_refused(url, target, requires):
    requires("logging")
    answer = requests.post(f"{url}/v2/logging", json={"log_file": "/tmp/conformance.log"})
    assert answer.status_code == 501, answer.text
    assert answer.json() == {"error": "log file location can not be updated through network protocol"}
    with grpcclient.InferenceServerClient(target.grpc) as client, pytest.raises(InferenceServerException) as raised:
        client.update_log_settings({"log_file": "/tmp/conformance.log"})
    assert raised.value.status() == str(grpc_module.StatusCode.UNIMPLEMENTED)
    assert requests.get(f"{url}/v2/logging").json()["log_file"] == ""


#: A setting of the wrong type or value: a client mistake.
BAD_LOG_SETTINGS = {
    "log_info_not_boolean": {"log_info": "yes"},
    "log_verbose_level_negative": {"log_verbose_level": -1},
    "log_format_unknown": {"log_format": "xml"},
}


@pytest.mark.spec("Triton extension_logging.md §Log Setting Response JSON Error Object: an HTTP error status (typically 400)")
@pytest.mark.parametrize("case", list(BAD_LOG_SETTINGS))
def test_bad_log_setting_is_4xx(url, case, requires, log_settings_restored):
    requires("logging")
    answer = requests.post(f"{url}/v2/logging", json=BAD_LOG_SETTINGS[case])
    assert 400 <= answer.status_code < 500, f"{answer.status_code}: {answer.text}"
    assert answer.json()["error"]
    assert requests.get(f"{url}/v2/logging").json() == {"log_file": "", **LOG_DEFAULTS}


@pytest.mark.spec("Triton extension_logging.md §GRPC: errors are a google.rpc.Status (INVALID_ARGUMENT)")
@pytest.mark.parametrize("setting", ["log_info", "log_verbose_level", "log_format"])
def test_bad_log_setting_over_grpc_is_invalid_argument(target, setting, requires, log_settings_restored):
    requires("logging")
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    wrong = {"log_info": {"string_param": "yes"}, "log_verbose_level": {"bool_param": True}, "log_format": {"string_param": "xml"}}
    request = pb.LogSettingsRequest(settings={setting: pb.LogSettingsRequest.SettingValue(**wrong[setting])})
    with grpc_module.insecure_channel(target.grpc) as channel, pytest.raises(grpc_module.RpcError) as raised:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).LogSettings(request)
    assert raised.value.code() == grpc_module.StatusCode.INVALID_ARGUMENT
    assert setting in raised.value.details()
