"""A relative --model_dir works in every control mode.

- `--model_dir <relative> --model_control_mode poll`, then a model copied in -> it loads and serves
  (it used to crash the server: the watcher's absolute paths were not under the relative root)
- the same directory, relative, under `none` and `explicit` -> loads, loads on request, serves
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import requests

from conftest import ROOT, copy_model, json_body, post_infer, start_server, stop_server, wait_for

WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])


def relative(path) -> str:
    """`path` relative to the directory the test servers start in (conftest.start_server runs them in ROOT)."""
    return os.path.relpath(path, ROOT)


#: simple's inputs: its OUTPUT0 is 2·i.
SIMPLE = json_body({"INPUT0": np.arange(16, dtype=np.int32).reshape(1, 16), "INPUT1": np.arange(16, dtype=np.int32).reshape(1, 16)})


@WORKERS
def test_poll_mode_loads_a_model_copied_into_a_relative_model_dir(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    server = start_server(relative(repository), tmp_path / "server.log", "--model_control_mode", "poll", workers=workers)
    try:
        assert not relative(repository).startswith("/")
        copy_model("simple", repository, "simple2")
        ready = f"{server.url}/v2/models/simple2/ready"
        wait_for(lambda: requests.get(ready, timeout=2).status_code == 200, "the copied model to be ready", server=server)
        assert post_infer(server, "simple2", SIMPLE).json()["outputs"][0]["data"] == [2 * i for i in range(16)]
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
        assert post_infer(server, "simple", SIMPLE).status_code == 200
        if mode == "explicit":
            copy_model("simple", repository, "later")
            assert requests.post(f"{server.url}/v2/repository/models/later/load", timeout=30).status_code == 200
            assert post_infer(server, "later", SIMPLE).status_code == 200
    finally:
        stop_server(server)
