"""The response cache: Triton's `local` cache (`--cache_config local,size=N`), answers of earlier requests
kept in a byte-bounded LRU and handed out again without running the model.

What Triton does, and where this follows it (triton-inference-server/core r24.10 and local_cache r24.10):
- The key: the model's name and version and every input, by name order, with its bytes
  (core `TritonCache::Hash`, src/cache_manager.cc). Triton's hash leaves out each input's datatype and
  shape and the outputs asked for, so with Triton 2.51 a [2,2] request with the bytes of an earlier
  [1,4] one is answered the [1,4] answer, and a request for OUTPUT1 the OUTPUT0 an earlier request asked
  for (measured: conformance/deviations.yaml). Here the key holds them too: every request is answered
  its own outputs. The version is the loaded version itself (`scope`), so a reloaded model never answers
  what the file it replaced computed. Triton's is a 64-bit boost hash (collisions answer wrongly, its
  documentation says); this is a 128-bit BLAKE2b.
- An entry's size is what Triton's packs (core `CacheEntry::GetByteSize`, src/cache_entry.cc): a 4-byte
  count, then per output its name, datatype and shape (each with a 4-byte length), an 8-byte size and
  its data. Entries are kept until their sizes would pass `size`; then the least recently used go
  (local_cache `LocalCache::Allocate` / `Evict`). An entry larger than the whole cache is not stored.
- An insert under a key already present (two equal requests that both missed) stores nothing, and the
  caller counts no miss for it (core `DynamicBatchScheduler::DelegateResponse`).
- The cache's own counters are Triton's `nv_cache_*` gauges (local_cache `LocalCache::InitMetrics`).

Used on the event loop only (the data plane's), so no locking.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping

import numpy as np

from .datatypes import from_numpy

#: The one cache implementation there is (Triton's `local`; its `redis` needs a Redis server).
LOCAL = "local"


class ResponseCache:
    """A byte-bounded LRU of answers (output name -> read-only array), keyed by `key`."""

    def __init__(self, size: int):
        self.size = size
        self.used = 0
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self._scopes = itertools.count(1)
        # Triton's local cache counters (its metrics), lookup and insertion times in microseconds.
        self.hits = self.misses = self.evictions = 0
        self.lookup_us = self.insertion_us = 0

    @staticmethod
    def parse(settings: list[str]) -> ResponseCache:
        """A cache from `--cache_config` values, Triton's `<cache>,<key>=<value>` (repeatable); ValueError says
        what is wrong."""
        names, config = set(), {}
        for setting in settings:
            name, _, pairs = setting.partition(",")
            names.add(name)
            for pair in filter(None, pairs.split(",")):
                key, equals, value = pair.partition("=")
                if not equals:
                    raise ValueError(f"'{pair}' is not <key>=<value> (as in local,size=1048576)")
                config[key] = value
        if names != {LOCAL}:
            raise ValueError(f"only the '{LOCAL}' cache is implemented, not {', '.join(sorted(names - {LOCAL}))}")
        if "size" not in config:
            raise ValueError("the local cache needs its size in bytes: local,size=N")
        unknown = sorted(set(config) - {"size"})
        if unknown:
            raise ValueError(f"the local cache takes only 'size', not {', '.join(unknown)}")
        if not config["size"].isdigit() or int(config["size"]) <= 0:
            raise ValueError(f"size must be a positive number of bytes, got {config['size']!r}")
        return ResponseCache(int(config["size"]))

    def scope(self, name: str, version: int) -> bytes:
        """What keys of one loaded version of a model start with (a new one at every load)."""
        return f"{name}\0{version}\0{next(self._scopes)}\0".encode()

    @staticmethod
    def key(scope: bytes, inputs: Mapping[str, np.ndarray], outputs: Collection[str]) -> bytes:
        """The key of a request: its version's scope, every input (name, datatype, shape, bytes) and the
        outputs asked for."""
        digest = hashlib.blake2b(scope, digest_size=16)
        for name in sorted(inputs):
            array = inputs[name]
            digest.update(f"{len(name)}:{name}{from_numpy(array.dtype)}{array.shape}".encode())
            if array.dtype.kind in "OSU":
                for item in _elements(array):
                    digest.update(len(item).to_bytes(4, "little"))
                    digest.update(item)
            else:
                digest.update(np.ascontiguousarray(array).data)
        digest.update("\0".join(sorted(outputs)).encode())
        return digest.digest()

    def lookup(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The answer stored under `key` (now the most recently used), or None."""
        start = time.perf_counter_ns()
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        self.lookup_us += (time.perf_counter_ns() - start) // 1000
        return None if entry is None else dict(entry[0])

    def insert(self, key: bytes, outputs: Mapping[str, np.ndarray]) -> bool:
        """Stores a copy of `outputs` under `key`, evicting the least recently used entries to make room;
        False if `key` was there already (stored by an equal request meanwhile). An answer larger than the
        cache is not stored."""
        start = time.perf_counter_ns()
        try:
            if key in self._entries:
                return False
            size = entry_size(outputs)
            if size > self.size:
                return True
            while self.used + size > self.size:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.used -= evicted
                self.evictions += 1
            self._entries[key] = ({name: _frozen(array) for name, array in outputs.items()}, size)
            self.used += size
            return True
        finally:
            self.insertion_us += (time.perf_counter_ns() - start) // 1000

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


def entry_size(outputs: Mapping[str, np.ndarray]) -> int:
    """Bytes of an answer as Triton packs it in its cache (core `CacheEntry::GetByteSize`)."""
    size = 4
    for name, array in outputs.items():
        size += 8 + 4 + len(name.encode()) + 4 + len(from_numpy(array.dtype)) + 4 + 8 * array.ndim + 8
        if array.dtype.kind in "OSU":
            size += sum(4 + len(item) for item in _elements(array))
        else:
            size += array.nbytes
    return size


def _elements(array: np.ndarray) -> Iterator[bytes]:
    """The elements of a BYTES array, each as bytes (a str as its UTF-8)."""
    return (item if isinstance(item, bytes) else str(item).encode() for item in array.ravel())


def _frozen(array: np.ndarray) -> np.ndarray:
    """A copy no later answer can change (the output may be a view of a whole batch's array)."""
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy


__all__ = ["LOCAL", "ResponseCache", "entry_size"]
