"""Tensors in shared memory between the engine and a frontend: each side writes into an arena it owns, the other reads in place.

An arena is a few memfd segments (anonymous shared memory: nothing is named in /dev/shm,
so nothing leaks when a process is killed, and a container's small /dev/shm, 64 MiB by
default, does not bound it), mapped by the process that owns it and, once the descriptor
has crossed the channel, by its peer. The owner writes a request's (or an answer's)
tensors into one block and sends where they lie; the peer makes numpy arrays over them
without a copy and, once every array made from the block is gone, tells the owner to free
it. Nothing but the owner touches its allocator, so no lock spans the two processes, and
the socket's send and receive order the writes before the reads on any CPU.

As Triton's python backend grows its shared memory pool (`shm-growth-byte-size`), an
arena adds a segment when its segments are full; a block larger than a segment gets one
of its own, unmapped on both sides once freed.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import weakref
from typing import Callable, Iterable, Sequence

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from ...core import datatypes
from .messages import Block, Drop, Message, Segment, Tensor

#: Blocks start on a cache line (and on any numpy dtype's alignment).
ALIGN = 64
#: A segment's size: address space reserved, memory spent only on the pages written.
SEGMENT_SIZE = 64 * 2**20

def _aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


class _Segment:
    """One memfd mapped here; with an allocator when this process owns it."""

    def __init__(self, fd: int, size: int):
        self.size = size
        self.mapping = mmap.mmap(fd, size)
        self.bytes = memoryview(self.mapping)
        self.free = [(0, size)]  # (offset, size), by offset; used only by the owner
        self.used: dict[int, int] = {}

    def take(self, size: int) -> int | None:
        for index, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, length - size)
                self.used[offset] = size
                return offset
        return None

    def give(self, offset: int) -> None:
        size = self.used.pop(offset)
        index = bisect.bisect(self.free, (offset, size))
        if index < len(self.free) and offset + size == self.free[index][0]:  # merge with the free span after
            size += self.free.pop(index)[1]
        if index and self.free[index - 1][0] + self.free[index - 1][1] == offset:  # and the one before
            offset, size = self.free[index - 1][0], self.free[index - 1][1] + size
            index -= 1
            del self.free[index]
        self.free.insert(index, (offset, size))

    @property
    def empty(self) -> bool:
        return not self.used


class Arena:
    """Shared memory this process writes tensors into for its peer.

    `announce(message, fd)` sends the peer a new segment (`Segment` with its memfd) or tells it
    to unmap one (`Drop`).
    """

    def __init__(self, announce: Callable[[Message, int | None], None], segment_size: int = SEGMENT_SIZE):
        self.announce = announce
        self.segment_size = segment_size
        self._segments: dict[int, _Segment] = {}
        self._ids = itertools.count()

    def _add(self, size: int) -> int:
        fd = os.memfd_create("kserve-ascend-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            segment = _Segment(fd, size)
        except BaseException:
            os.close(fd)
            raise
        number = next(self._ids)
        self._segments[number] = segment
        self.announce(Segment(number, size), fd)  # the channel closes our descriptor once it is sent
        return number

    def allocate(self, size: int) -> tuple[int, int]:
        """(segment, offset) of `size` free bytes, adding a segment if none has them."""
        size = _aligned(max(size, 1))
        for number, segment in self._segments.items():
            if segment.size == self.segment_size:
                offset = segment.take(size)
                if offset is not None:
                    return number, offset
        number = self._add(max(self.segment_size, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE))
        return number, self._segments[number].take(size)

    def put(self, payloads: Sequence[np.ndarray | bytes]) -> tuple[Block | None, list[int]]:
        """Writes each payload into one block: the block and each payload's offset in it (None: nothing to write)."""
        offsets, size = [], 0
        for payload in payloads:
            offsets.append(size)
            size += _aligned(len(payload) if isinstance(payload, bytes) else payload.nbytes)
        if not size:
            return None, offsets
        number, start = self.allocate(size)
        segment = self._segments[number]
        for payload, offset in zip(payloads, offsets):
            at = start + offset
            if isinstance(payload, bytes):
                segment.bytes[at : at + len(payload)] = payload
            elif not payload.nbytes:
                continue
            elif payload.flags.c_contiguous:
                segment.bytes[at : at + payload.nbytes] = memoryview(payload.reshape(-1)).cast("B")
            else:
                target = np.frombuffer(segment.mapping, payload.dtype, payload.size, at)
                np.copyto(target.reshape(payload.shape), payload, casting="no")
        return Block(number, start, size), offsets

    def free(self, number: int, offset: int) -> None:
        """The peer no longer reads the block at `offset` of segment `number`."""
        segment = self._segments.get(number)
        if segment is None:
            return
        segment.give(offset)
        if segment.empty and segment.size != self.segment_size:
            # A block that outgrew the segments had one of its own: give its memory back.
            del self._segments[number]
            self.announce(Drop(number), None)

    def close(self) -> None:
        self._segments.clear()  # each unmapped once nothing refers to it any more

    @property
    def blocks(self) -> int:
        """Blocks the peer has not freed yet."""
        return sum(len(segment.used) for segment in self._segments.values())


class Mapped:
    """The peer's arena, mapped here segment by segment as it announces them: its tensors read in place.

    `release(block)` is called once every array made from a block is gone (on whichever
    thread dropped the last one), so the peer may reuse it.
    """

    def __init__(self, release: Callable[[Block], None]):
        self.release = release
        self._segments: dict[int, mmap.mmap] = {}
        self._alive: dict[int, tuple[weakref.ref, Block]] = {}  # by id: a weakref hashes as its (unhashable) array

    def add(self, number: int, size: int, fd: int) -> None:
        try:
            self._segments[number] = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def drop(self, number: int) -> None:
        self._segments.pop(number, None)  # unmapped once nothing refers to it any more

    def tensors(self, block: Block | None, tensors: Iterable[Tensor]) -> dict[str, np.ndarray]:
        """Read-only arrays over the block, one per tensor that lies in it."""
        if block is None:
            return {t.name: np.empty(t.shape, datatypes.to_numpy(t.datatype)) for t in tensors}
        base = np.frombuffer(self._segments[block.segment], np.uint8, block.size, block.offset)
        base.flags.writeable = False
        arrays = {}
        for tensor in tensors:
            data = base[tensor.offset : tensor.offset + tensor.nbytes]
            if tensor.datatype == "BYTES":
                arrays[tensor.name] = deserialize_bytes_tensor(data).reshape(tensor.shape)  # a copy: the elements are objects
            else:
                arrays[tensor.name] = data.view(datatypes.to_numpy(tensor.datatype)).reshape(tensor.shape)
        # Every array above is a view of `base` (numpy keeps the first array that owns no data as the base):
        # when `base` dies, so has every view, and the peer may write the block again.
        ref = weakref.ref(base, self._dead)
        self._alive[id(ref)] = ref, block
        return arrays

    def _dead(self, ref: weakref.ref) -> None:
        entry = self._alive.pop(id(ref), None)
        if entry is not None:
            self.release(entry[1])

    def close(self) -> None:
        self._alive.clear()  # nothing to release to a peer that is gone
        self._segments.clear()


def write(arena: Arena, arrays: Iterable[tuple[str, np.ndarray]]) -> tuple[Block | None, list[Tensor]]:
    """Tensors into one block of `arena`: the block, and where each lies in it (what `Mapped.tensors` reads).

    A BYTES tensor is written serialized, as Triton's length-prefixed elements.
    """
    tensors, data = [], []
    for name, array in arrays:
        if array.dtype.kind in "OSU":
            payload = serialize_byte_tensor(array.astype(object, copy=False)).item() if array.size else b""
            tensors.append(Tensor(name, "BYTES", list(array.shape), 0, len(payload)))
            data.append(payload)
        else:
            tensors.append(Tensor(name, datatypes.from_numpy(array.dtype), list(array.shape), 0, array.nbytes))
            data.append(array)
    block, offsets = arena.put(data)
    for tensor, offset in zip(tensors, offsets):
        tensor.offset = offset
    return block, tensors
