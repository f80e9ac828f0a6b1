"""Triton's system shared memory extension: the regions clients register, each mapped once.

A region is a window (offset, byte_size) of a POSIX shared memory object the client made
with shm_open and names by its key. Inputs are read from it in place and outputs written
into it, so tensor data never travels in requests or responses. Both edges share one
registry on the event loop, so it needs no lock. With `--workers N` the engine's registry
is the one clients change; each frontend maps the same regions to decode and encode in
place (`workers.remote.RemoteRegions`), and the engine reads inputs from its own mapping.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from ...core.errors import InvalidInput

log = logging.getLogger(__name__)

#: Where Linux keeps POSIX shared memory objects: shm_open("/name") opens /dev/shm/name.
SHM_DIR = "/dev/shm"
#: Triton's shared memory examples first clear CUDA regions. With no CUDA device none can
#: exist, so the edges answer CUDA status and unregister with none and refuse to register
#: (the cuda_shared_memory extension is not declared).
CUDA_SHM_UNSUPPORTED = "CUDA shared memory is not supported: this server has no CUDA devices"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    #: Where the region starts in `mapping`: mmap offsets must be page-aligned, region offsets need not be.
    start: int
    #: Where the region starts in this process's memory.
    address: int = 0
    #: Which registration this is: a region registered again under its name (another object, maybe under the
    #: same key) has another.
    serial: int = 0

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SharedMemoryRegistry:
    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        #: How many times a region was registered or unregistered.
        self.changes = 0

    def register(self, name: str, key, offset, byte_size) -> None:
        """Maps `byte_size` bytes at `offset` of shared memory object `key` read-write as region `name`.

        The arguments are checked here: over REST they come straight from the JSON body.
        """
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        if name in self._regions:
            raise InvalidInput(f"shared memory region '{name}' already in manager")
        what = f"shared memory region '{name}'"
        _check_integer(offset, "offset", what, minimum=0)
        _check_integer(byte_size, "byte_size", what, minimum=1)  # mmap maps the whole object for a length of 0
        path = _object_path(key, what)
        try:
            # O_NOFOLLOW as shm_open itself: a symlink planted in /dev/shm must not map another file.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise InvalidInput(f"unable to register {what}: cannot open shared memory object '{key}': {error.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"unable to register {what}: '{key}' is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise InvalidInput(
                    f"unable to register {what}: offset {offset} + byte_size {byte_size} is beyond "
                    f"the {info.st_size} bytes of shared memory object '{key}'"
                )
            start = offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
        finally:
            os.close(fd)  # the mapping keeps its own descriptor
        address = np.frombuffer(mapping, np.uint8).ctypes.data + start
        self.changes += 1
        self._regions[name] = Region(name, key, offset, byte_size, mapping, start, address, self.changes)
        log.info("registered %s: %d bytes at offset %d of '%s'", what, byte_size, offset, key)

    def unregister(self, name: str = "") -> None:
        """Unregisters region `name`, or every region; an unknown name is no error (as in Triton)."""
        names = [name] if name else list(self._regions)
        for region in filter(None, (self._regions.pop(n, None) for n in names)):
            self.changes += 1
            try:
                region.mapping.close()
            except BufferError:
                # A request in flight still holds tensors over it: the mapping is unmapped when they are dropped.
                pass
            log.info("unregistered shared memory region '%s'", region.name)

    def close(self) -> None:
        """Unmaps every region, at server shutdown."""
        self.unregister()

    def status(self, name: str = "") -> list[dict]:
        """Every region's status, or region `name`'s (which must be registered)."""
        if not name:
            return [region.status() for region in self._regions.values()]
        if name not in self._regions:
            raise InvalidInput(f"Unable to find system shared memory region: '{name}'")
        return [self._regions[name].status()]

    def registrations(self) -> list[list]:
        """Every region as [name, key, offset, byte_size, serial]: what another process maps to share the registry."""
        return [[r.name, r.key, r.offset, r.byte_size, r.serial] for r in self._regions.values()]

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """The `byte_size` bytes at `offset` of region `name`, in place, for tensor `what`."""
        region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"{what} names shared memory region '{name}', which is not registered")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(
                f"{what} spans bytes {offset}..{offset + byte_size} of shared memory region '{name}', "
                f"which has {region.byte_size}"
            )
        start = region.start + offset
        return memoryview(region.mapping)[start : start + byte_size]

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        """(region, offset) of a contiguous array that lies in a registered region, else None."""
        if not self._regions or not array.flags.c_contiguous or not array.nbytes:
            return None
        address = array.ctypes.data
        for region in self._regions.values():
            if region.address <= address and address + array.nbytes <= region.address + region.byte_size:
                return region.name, address - region.address
        return None


def _check_integer(value, key: str, what: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive" if minimum else "a non-negative"
        raise InvalidInput(f"'{key}' of {what} must be {kind} integer, got {value!r}")


def _object_path(key, what: str) -> str:
    # As shm_open: leading slashes are optional and no other is allowed, so a key can
    # only name a file of /dev/shm, never a path elsewhere; nor can a path hold a NUL.
    name = key.lstrip("/") if isinstance(key, str) else ""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidInput(f"'key' of {what} must name a POSIX shared memory object such as '/data', got {key!r}")
    return os.path.join(SHM_DIR, name)
