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


# ---------------------------------------------------------------- trace

#: Triton's trace settings as a server started without --trace-config answers them (both servers, in the suite).
TRACE_DEFAULTS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
_CLEARED = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}


@pytest.fixture
def trace_settings_restored(url):
    yield
    requests.post(f"{url}/v2/models/simple/trace/setting", json=_CLEARED).raise_for_status()
    restored = {k: v for k, v in TRACE_DEFAULTS.items() if k not in ("trace_file", "trace_mode")}
    requests.post(f"{url}/v2/trace/setting", json=restored).raise_for_status()


def trace_setting(url: str, model: str = "", **changes) -> requests.Response:
    path = f"{url}/v2/models/{model}/trace/setting" if model else f"{url}/v2/trace/setting"
    return requests.post(path, json=changes) if changes else requests.get(path)


@pytest.mark.spec("Triton extension_trace.md §Trace Setting Response JSON Object")
def test_trace_settings_answered(url, grpc, requires):
    requires("trace")
    for path in ("/v2/trace/setting", "/v2/models/simple/trace/setting"):
        answer = requests.get(url + path)
        assert answer.status_code == 200 and answer.json() == TRACE_DEFAULTS, answer.text
    over_grpc = grpc.get_trace_settings(as_json=True)["settings"]
    assert {name: value.get("value", [""]) for name, value in over_grpc.items()} == {
        name: value if isinstance(value, list) else [value] for name, value in TRACE_DEFAULTS.items()
    }


@pytest.mark.spec("Triton extension_trace.md §Trace Setting Request JSON Object: a model's settings; null uses the global one")
def test_model_trace_setting_overrides_the_global_one(url, grpc, requires, trace_settings_restored):
    requires("trace")
    assert trace_setting(url, "simple", trace_rate="5").json() == {**TRACE_DEFAULTS, "trace_rate": "5"}
    assert trace_setting(url).json() == TRACE_DEFAULTS
    # Fields not given for the model follow the global ones.
    assert trace_setting(url, trace_count="7").json()["trace_count"] == "7"
    assert trace_setting(url, "simple").json() == {**TRACE_DEFAULTS, "trace_rate": "5", "trace_count": "7"}
    # Over gRPC (tritonclient: None clears, as JSON's null does over REST).
    grpc.update_trace_settings(model_name="simple", settings={"trace_rate": "6"})
    assert trace_setting(url, "simple").json()["trace_rate"] == "6"
    grpc.update_trace_settings(model_name="simple", settings={"trace_rate": None})
    assert trace_setting(url, "simple").json() == {**TRACE_DEFAULTS, "trace_count": "7"}
    assert trace_setting(url, "simple", trace_count=None).json() == {**TRACE_DEFAULTS, "trace_count": "7"}
    assert trace_setting(url, trace_count="-1").json() == TRACE_DEFAULTS
    assert trace_setting(url, "simple").json() == TRACE_DEFAULTS


#: Changes refused with 400 and Triton's words (the model's, or the global setting).
BAD_TRACE_SETTINGS = {
    "rate_not_a_number": ("", {"trace_rate": "x"}, "Unable to parse 'trace_rate', got: x"),
    "rate_out_of_range": ("", {"trace_rate": "99999999999"}, "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: 99999999999"),
    "count_below_minus_one": ("", {"trace_count": "-2"}, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    "log_frequency_not_a_number": ("", {"log_frequency": "often"}, "Unable to parse 'log_frequency', got: often"),
    "off_and_another_level": ("", {"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF' is specified"),
    "level_on_without_file": ("", {"trace_level": ["TIMESTAMPS"]}, "Attempting to set invalid trace setting :trace file name is not given"),
    "model_level_on_rate_zero": ("simple", {"trace_level": ["TIMESTAMPS"], "trace_rate": "0"}, "Attempting to set invalid trace setting :sample rate must be non-zero"),
}


@pytest.mark.spec("Triton extension_trace.md §Trace Setting Response JSON Error Object (Triton's messages)")
@pytest.mark.parametrize("case", list(BAD_TRACE_SETTINGS))
def test_bad_trace_setting_is_400(url, target, case, requires, trace_settings_restored):
    requires("trace")
    model, change, words = BAD_TRACE_SETTINGS[case]
    answer = trace_setting(url, model, **change)
    assert answer.status_code == 400 and answer.json() == {"error": words}, f"{answer.status_code}: {answer.text}"
    assert trace_setting(url, model).json() == TRACE_DEFAULTS
    with grpcclient.InferenceServerClient(target.grpc) as client, pytest.raises(InferenceServerException) as raised:
        client.update_trace_settings(model_name=model or None, settings=change)
    # Triton's gRPC text differs from its REST one by a space ("got: -2", "got:-2").
    assert raised.value.status() == str(grpc_module.StatusCode.INVALID_ARGUMENT)
    assert raised.value.message().replace(" ", "") == words.replace(" ", "")


@pytest.mark.spec("Triton extension_trace.md: a client error is an HTTP error status (typically 400); values are strings")
@pytest.mark.parametrize("change", [{"trace_rate": 5}, {"trace_level": "TIMESTAMPS"}], ids=["rate_a_number", "level_not_a_list"])
def test_trace_setting_of_wrong_json_type_is_4xx(url, change, requires, trace_settings_restored):
    requires("trace")
    answer = trace_setting(url, **change)
    assert 400 <= answer.status_code < 500 and answer.json()["error"], f"{answer.status_code}: {answer.text}"


@pytest.mark.spec("Triton extension_trace.md: 'trace_file' cannot be updated (Triton: UNSUPPORTED, 501)")
def test_trace_file_change_refused(url, target, requires, trace_settings_restored):
    requires("trace")
    answer = trace_setting(url, trace_file="/tmp/conformance-trace.json")
    assert answer.status_code == 501, answer.text
    assert answer.json() == {"error": "trace file location can not be updated through network protocol"}
    with grpcclient.InferenceServerClient(target.grpc) as client, pytest.raises(InferenceServerException) as raised:
        client.update_trace_settings(settings={"trace_file": "/tmp/conformance-trace.json"})
    assert raised.value.status() == str(grpc_module.StatusCode.UNIMPLEMENTED)


@pytest.mark.spec("Triton extension_trace.md: a model's trace setting needs the model (Triton: 400 for one unknown or not ready)")
def test_trace_setting_of_unknown_model_is_400(url, target, requires):
    requires("trace")
    answer = trace_setting(url, "no_such_model")
    assert answer.status_code == 400 and answer.json() == {"error": "Request for unknown model : no_such_model"}, answer.text
    with grpcclient.InferenceServerClient(target.grpc) as client, pytest.raises(InferenceServerException) as raised:
        client.get_trace_settings(model_name="no_such_model")
    assert raised.value.status() == str(grpc_module.StatusCode.INVALID_ARGUMENT)


@pytest.mark.spec("Triton extension_trace.md: v2[/models/${MODEL_NAME}]/trace/setting, with no version")
def test_trace_setting_has_no_version_route(url, requires):
    requires("trace")
    answer = requests.get(f"{url}/v2/models/simple/versions/1/trace/setting")
    assert answer.status_code == 404 and "error" in answer.json(), answer.text
