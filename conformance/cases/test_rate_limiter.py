"""Triton's rate limiter as seen on the wire: a model instance's `rate_limiter` is served, and a config whose
resources the server does not have is refused at load, with Triton's reason in the load answer and the index.

The suite's server runs with the rate limiter on and one resource, `conformance_slot` (Triton:
`--rate-limit=execution_count --rate-limit-resource=conformance_slot:1`; kserve-ascend:
`--rate_limit execution_count --rate_limit_resource conformance_slot:1`); `rate_limited` needs one.
The reasons are Triton core's (src/rate_limiter.cc, ResourceManager), as real Triton 2.51 answers them.
"""

import json

import pytest
import requests

MODEL = "rate_limited"


def config(*groups: dict) -> str:
    """`rate_limited`'s config (as its config.pbtxt) with these instance groups: a config override."""
    return json.dumps({
        "name": MODEL, "backend": "ascend", "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [-1]}],
        "parameters": {"runtime": {"string_value": "sim"}},
        "instance_group": list(groups),
    })  # fmt: skip


def group(*resources: dict) -> dict:
    return {"kind": "KIND_MODEL", "count": 1, "rate_limiter": {"resources": list(resources), "priority": 2}}


#: Configs the server has not the resources for, and Triton's reason.
OVER_BUDGET = {
    "count_above_the_flag": (
        config(group({"name": "conformance_slot", "count": 2})),
        (
            'Resource count for "conformance_slot" is limited to 1 which will prevent scheduling of one or more model'
            " instances, the minimum required count is 2"
        ),
    ),
    "resource_no_flag_gives": (
        config(group({"name": "conformance_unlisted", "count": 1})),
        (
            'Resource count for "conformance_unlisted" is limited to 0 which will prevent scheduling of one or more'
            " model instances, the minimum required count is 1"
        ),
    ),
    "global_and_per_device": (
        config(group({"name": "conformance_slot", "count": 1}), group({"name": "conformance_slot", "count": 1, "global": True})),
        'Resource "conformance_slot" is present as both global and device-specific resource in the model configuration.',
    ),
}


def load(url: str, override: str | None = None) -> requests.Response:
    body = {"parameters": {"config": override}} if override else {}
    return requests.post(f"{url}/v2/repository/models/{MODEL}/load", json=body, timeout=60)


def unload(url: str) -> requests.Response:
    return requests.post(f"{url}/v2/repository/models/{MODEL}/unload", json={}, timeout=60)


def assert_identity(url: str) -> None:
    data = [3, 1, 4, 1, 5]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 5], "datatype": "INT32", "data": data}]}
    response = requests.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == data


@pytest.mark.spec("Triton rate_limiter.md §Resources; model_configuration.md §Rate Limiter Configuration")
def test_rate_limited_model_serves(url, http, requires):
    assert_identity(url)
    requires("model_configuration")
    (instance_group,) = http.get_model_config(MODEL)["instance_group"]
    assert instance_group["rate_limiter"] == {
        "resources": [{"name": "conformance_slot", "global": False, "count": 1}], "priority": 2,
    }


@pytest.mark.spec("Triton rate_limiter.md §Resources (--rate-limit-resource); extension_model_repository.md §Load, §Index")
@pytest.mark.parametrize("case", list(OVER_BUDGET))
def test_rate_limiter_refuses_a_config_the_server_has_not_the_resources_for(url, case, requires):
    requires("model_repository")
    override, reason = OVER_BUDGET[case]
    assert unload(url).status_code == 200
    try:
        answer = load(url, override)
        assert answer.status_code == 400, answer.text
        assert reason in answer.json()["error"]
        (entry,) = [e for e in requests.post(f"{url}/v2/repository/index", json={}, timeout=10).json() if e["name"] == MODEL]
        assert entry["state"] == "UNAVAILABLE" and reason in entry["reason"]
    finally:
        assert load(url).status_code == 200  # config.pbtxt again: it fits
    assert_identity(url)


@pytest.mark.spec("Triton rate_limiter.md §Resources; extension_model_repository.md §Load")
def test_rate_limiter_refused_reload_leaves_the_served_version_serving(url, requires):
    """A reload whose instances would need `conformance_slot` as a global resource, while the served version's
    need it per device: refused in Triton's words, and the served version serves on."""
    requires("model_repository")
    answer = load(url, config(group({"name": "conformance_slot", "count": 1, "global": True})))
    assert answer.status_code == 400, answer.text
    assert OVER_BUDGET["global_and_per_device"][1] in answer.json()["error"]
    assert_identity(url)


@pytest.mark.spec("Triton rate_limiter.md §Resources: a resource is per device unless global")
def test_rate_limiter_global_resource_within_the_budget_serves(url, requires):
    """A global resource counts the largest count given for its name: one global slot fits. (Unloaded first:
    while the per-device version is registered, a global one of the same name is refused, as above.)"""
    requires("model_repository")
    assert unload(url).status_code == 200
    try:
        assert load(url, config(group({"name": "conformance_slot", "count": 1, "global": True}))).status_code == 200
        assert_identity(url)
    finally:
        assert unload(url).status_code == 200
        assert load(url).status_code == 200
    assert_identity(url)
