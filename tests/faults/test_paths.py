"""A relative --model_dir works in every control mode.

- `--model_dir <relative> --model_control_mode poll`, then a model copied in -> it loads and serves
  (it used to crash the server: the watcher's absolute paths were not under the relative root)
- the same directory, relative, under `none` and `explicit` -> loads, loads on request, serves
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import requests

from conftest import ROOT, copy_model, start_server, stop_server

WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])


def relative(path) -> str:
    """`path` relative to the directory the test servers start in (conftest.start_server runs them in ROOT)."""
    return os.path.relpath(path, ROOT)


def infer_simple(url: str, model: str) -> requests.Response:
    data = np.arange(16).tolist()
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": data},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": data},
        ]
    }
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=10)


@WORKERS
def test_poll_mode_loads_a_model_copied_into_a_relative_model_dir(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    server = start_server(relative(repository), tmp_path / "server.log", "--model_control_mode", "poll", workers=workers)
    try:
        assert not relative(repository).startswith("/")
        copy_model("simple", repository, "simple2")
        deadline = time.monotonic() + 30
        while requests.get(f"{server.url}/v2/models/simple2/ready", timeout=2).status_code != 200:
            assert server.process.poll() is None, server.output()[-3000:]
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.2)
        assert infer_simple(server.url, "simple2").json()["outputs"][0]["data"] == [2 * i for i in range(16)]
        assert "Traceback" not in server.output()
    finally:
        stop_server(server)


@WORKERS
@pytest.mark.parametrize("mode", ["none", "explicit"])
def test_a_relative_model_dir_serves_in_the_other_control_modes(tmp_path, workers, mode):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    extra = ("--model_control_mode", mode, *(("--load_model", "simple") if mode == "explicit" else ()))
    server = start_server(relative(repository), tmp_path / "server.log", *extra, workers=workers)
    try:
        assert infer_simple(server.url, "simple").status_code == 200
        if mode == "explicit":
            copy_model("simple", repository, "later")
            assert requests.post(f"{server.url}/v2/repository/models/later/load", timeout=30).status_code == 200
            assert infer_simple(server.url, "later").status_code == 200
    finally:
        stop_server(server)
