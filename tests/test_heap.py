"""What a serving process loaded at start is kept out of full garbage collections (core/heap.py): the p99's cause."""

from __future__ import annotations

import gc
import weakref

import pytest

from conftest import REPOSITORY, start_server, stop_server
from kserve_ascend.core import heap


class Node:
    def __init__(self):
        self.other = self


def test_settle_collects_the_garbage_there_is_then_freezes_what_lives():
    alive = Node()  # a cycle still referenced: frozen
    dropped = Node()  # a cycle no longer referenced: collected, not frozen for ever
    gone = weakref.ref(dropped)
    del dropped
    try:
        frozen = heap.settle("test")
        assert gone() is None
        assert frozen == gc.get_freeze_count() > 0
        assert not in_oldest_generation(alive)  # frozen: in no generation a collection visits
    finally:
        gc.unfreeze()
    assert in_oldest_generation(alive)


def in_oldest_generation(thing: object) -> bool:
    return any(o is thing for o in gc.get_objects(generation=2))


@pytest.mark.parametrize("workers", [1, 2])
def test_every_serving_process_settles_once_it_serves(tmp_path, workers):
    server = start_server(REPOSITORY, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "simple",
                          workers=workers)  # fmt: skip
    stop_server(server)
    lines = [line for line in server.log.read_text().splitlines() if "kept out of the garbage collector" in line]
    expected = ["repository loaded"] + [f"frontend {i} serving" for i in range(workers if workers > 1 else 0)]
    assert sorted(line.split("]")[-1].split(":")[0].strip() for line in lines) == sorted(expected), lines
