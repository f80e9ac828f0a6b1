"""Issue 30, tested as a fleet: 30 models of 100 MB, at most 10 fit, served on demand to 16 clients.

The load is bench/fleet.py's (`make bench` reports its cold-start wait, warm latency and hit rate):
a hot set of 8 asked for 4 times each for every request to one of the 22 cold ones. Each run: no
request fails, at no sample are more than 10 models loaded (by the repository index and by
/metrics), the hot set is loaded at every sample, and every model answered correctly. With `sim`
models that really allocate their 100 MB, in one process and with `--workers 2`, and with `.om`
models on the FAKE pyACL, whose device has 2024 MB: the default budget, its free memory less the
1024 MB reserve, is 1000 MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import ROOT, fake_acl_env, load_fake_acl, start_server, stop_server

sys.path.insert(0, str(ROOT / "bench"))
import fleet  # noqa: E402

MB = 1 << 20
#: The shortest run that shows it (each runs on until every model was asked for).
SECONDS = 4


def om_repository(root: Path) -> Path:
    """30 `.om` models (FAKE pyACL descriptors) whose load takes 100 MB of the device (their buffers included)."""
    acl = load_fake_acl()
    for name in fleet.names():
        (root / name / "1").mkdir(parents=True)
        acl.fake_write_om(root / name / "1" / "model.om", [("x", acl.ACL_FLOAT, [1, 4])], weight_size=100 * MB - 4096)
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 1\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\noutput [ { name: "x_out" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        )
    return root


def check(run: fleet.Fleet) -> None:
    models, hot = fleet.names(), set(fleet.names()[: fleet.HOT])
    assert run.failures == [], run.failures[:5]
    assert set(run.correct) == set(models)  # every model answered correctly at least once
    assert len(run.samples) >= 4
    for ready, held in run.samples:
        assert len(ready) <= 10 and len(held) <= 10, (sorted(ready), sorted(held))
        assert hot <= ready and hot <= held, sorted(hot - ready)  # the hot set stays loaded
    assert sum(run.metrics.values("ascend_model_evictions")) > 0  # more models served than fit
    assert run.metrics.values("ascend_model_evictions", model="model00") == [0.0]  # the hottest: never evicted


@pytest.mark.parametrize("workers", [1, 2])
def test_thirty_sim_models_of_100_mb_in_a_1000_mb_budget(tmp_path, workers):
    repository = fleet.write_sim_repository(tmp_path / "repository")
    server = start_server(repository, tmp_path / "server.log", "--memory_budget_mb", "1000", "--load_on_demand", workers=workers)
    try:
        run = fleet.drive(server, fleet.names(), SECONDS)
    finally:
        stop_server(server)
    check(run)
    assert run.metrics("ascend_device_memory_budget_bytes", device="0") == 1000 * MB
    assert run.metrics("ascend_model_memory_bytes", model="model00", version="1") == 100 * MB


def test_thirty_om_models_in_the_default_budget_of_the_fake_device(tmp_path):
    repository = om_repository(tmp_path / "repository")
    env = {**fake_acl_env(), "FAKE_ACL_DEVICE_MEMORY_MB": "2024"}
    server = start_server(repository, tmp_path / "server.log", "--load_on_demand", env=env)
    try:
        run = fleet.drive(server, fleet.names(), SECONDS, tensor=("x", "x_out"))
    finally:
        stop_server(server)
    check(run)
    metrics = run.metrics
    assert metrics("ascend_device_memory_total_bytes", device="0") == 2024 * MB  # acl.rt.get_mem_info's
    assert metrics("ascend_device_memory_budget_bytes", device="0") == 1000 * MB  # its free memory less the reserve
    assert metrics("ascend_device_memory_used_bytes", device="0") <= 1000 * MB
    # What the device's free memory lost to the load: the model's weights and its input and output buffers.
    assert metrics("ascend_model_memory_bytes", model="model00", version="1") == 100 * MB - 4096 + 2 * 16
