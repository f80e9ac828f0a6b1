"""KServe's `--event-loop` in every serving process: "auto" (its default) is uvloop where installed (server/cli.py)."""

from __future__ import annotations

import argparse
import sys

import pytest

from conftest import REPOSITORY, start_server, stop_server
from kserve_ascend.server import cli


def loops(server) -> list[str]:
    return [line.rsplit("event loop: ", 1)[1] for line in server.log.read_text().splitlines() if "event loop: " in line]


@pytest.mark.parametrize("workers", [1, 2])
def test_every_serving_process_runs_on_uvloop_by_default(tmp_path, workers):
    server = start_server(REPOSITORY, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "simple",
                          workers=workers)  # fmt: skip
    stop_server(server)
    assert loops(server) == ["uvloop"] * (1 + (workers if workers > 1 else 0))  # the one process, or the engine and each frontend


def test_event_loop_asyncio_is_asyncio(tmp_path):
    server = start_server(REPOSITORY, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "simple",
                          "--event-loop", "asyncio")  # fmt: skip
    stop_server(server)
    assert loops(server) == ["asyncio"]


def test_auto_falls_back_to_asyncio_and_uvloop_asked_for_is_an_error_when_uvloop_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    ran = []
    monkeypatch.setattr(cli.asyncio, "run", ran.append)
    cli.run_event_loop(argparse.Namespace(event_loop="auto"), "main")
    assert ran == ["main"]
    with pytest.raises(SystemExit, match="--event-loop uvloop, but uvloop is not installed"):
        cli.run_event_loop(argparse.Namespace(event_loop="uvloop"), "main")
