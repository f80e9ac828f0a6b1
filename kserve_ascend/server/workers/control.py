"""A page of shared memory the engine writes and every frontend reads: how many times the shared memory
registry and the repository have changed.

The engine sends every frontend what changed (`messages.Regions`, `messages.ModelsChanged`)
before it moves a count here, so a frontend that reads a count it has not caught up with finds
the message already in its socket, and reads it at once (`Channel.drain`), without waiting.
A request a client sends through one frontend right after another frontend answered its
registration or its load thus meets the new regions or the new model, never the old.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

#: The counts, by index.
REGIONS, MODELS = 0, 1


class ControlPage:
    SIZE = mmap.PAGESIZE

    def __init__(self, fd: int, writable: bool):
        try:
            self._mapping = mmap.mmap(fd, self.SIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            if not writable:
                os.close(fd)
        self._fd = fd if writable else None
        self.counts = np.frombuffer(self._mapping, np.int64, 2)

    @classmethod
    def create(cls) -> "ControlPage":
        """The engine's page."""
        fd = os.memfd_create("kserve-ascend-control", os.MFD_CLOEXEC)
        os.ftruncate(fd, cls.SIZE)
        return cls(fd, writable=True)

    def share(self) -> int:
        """A descriptor of the page for a frontend (which maps it read-only)."""
        return os.dup(self._fd)

    def count(self, index: int, value: int) -> None:
        self.counts[index] = value

    def __getitem__(self, index: int) -> int:
        return int(self.counts[index])
