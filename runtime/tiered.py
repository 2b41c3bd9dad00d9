"""One MLP unit of a neuron store (runtime/store.py): its hot neurons pinned in a range of the store's arena, its
cold ones read on demand into the store's shared pool of cache slots (the MLPUnit contract: runtime/units.py)."""

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.units import Request

if TYPE_CHECKING:
    from sparseforge.runtime.store import NeuronStore

COUNTERS = ("requests", "neurons", "hot_hits", "cache_hits", "misses", "evictions", "bytes_read", "records_read", "record_bytes", "reads")


@dataclass
class ReadJob:
    """One batch of cold bundles for the reader thread."""

    unit: "TieredUnit"
    neurons: np.ndarray  # int64 [m] neuron ids
    slots: np.ndarray  # int64 [m] their slots in the store's arena
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class TieredUnit:
    """One MLP unit of a NeuronStore: its hot neurons pinned in arena slots from `offset` on, its cold ones read on
    demand into the store's shared pool of cache slots. The slot bookkeeping is numpy (a request is a few dozen small
    array operations; numpy's per-call cost is a fraction of torch's)."""

    local = None  # every neuron is computed through the unit (runtime/units.py)
    fixed_slots = None  # slots change as neurons come and go
    tied = False  # slots are not neuron ids (an arena of pair records: a slot per pair, named per half; `pairs`: halves in two slots)

    def __init__(self, store: "NeuronStore", layer: int, expert: int, index: int, offset: int, hot: torch.Tensor):
        f = store.file
        self.store, self.layer, self.expert, self.index, self.offset = store, layer, expert, index, offset
        self.hidden, self.intermediate = f.hidden, f.index["intermediate"]
        self.hot = int(hot.numel())
        self.bundles, self.scales = store.bundles, store.scales  # the arena every unit of the store shares
        self.channels = f.channels(layer, expert)  # int8: the unit's down-column channel scales (always resident), else None
        self.position = f.positions(layer, expert).numpy()  # [I] neuron -> record position in the file (chunk order)
        self.records = store.records  # a slot holds a pair record (module docstring), keyed by pair
        self.pairs = f.pairs(layer, expert) and not self.records  # a pair record's halves scattered to two bundle slots
        self.record_bytes = f.record_bytes(layer, expert)
        self.keys = self.intermediate // 2 if self.records else self.intermediate  # what a slot holds: a pair, or a neuron
        self.pair_requests = self.records  # request(pairs, pairs=True): pairs named by their record's slot (runtime/units.py)
        self.slot_of = np.full(self.keys, -1, dtype=np.int64)  # [keys] pair or neuron -> arena slot, -1 not resident
        self.jobs: list[ReadJob] = []
        self.counts = dict.fromkeys(COUNTERS, 0)
        keys = np.unique(self._key(hot.numpy()))  # slots in neuron order: the kernels then walk the hot slots sequentially
        # a request of k neurons needs min(k, cold keys) free pool slots
        self.capacity = self.intermediate if store.pool_slots >= self.keys - keys.size else store.pool_slots
        if keys.size:  # hot neurons: one read of the head of the unit's records (frequency order)
            slots = offset + np.arange(keys.size)
            store.fill(slots, f.read(layer, expert, self.position[keys]), self._halves(keys))
            self.slot_of[keys] = slots
            store.neuron_in[slots], store.owner[slots] = keys, index
        self.load_bytes = np.unique(self.position[keys]).size * self.record_bytes

    def _key(self, neurons: np.ndarray) -> np.ndarray:
        """What holds `neurons` in a slot: their pairs in an arena of pair records, else the neurons themselves."""
        return neurons % self.keys if self.records else neurons

    # ---------------------------------------------------------------- the MLPUnit interface

    def order(self, neurons: torch.Tensor) -> torch.Tensor:
        """File order: chunks of neighbouring records turn each chunk's misses into a few long reads."""
        return neurons[torch.from_numpy(np.argsort(self.position[neurons.numpy()], kind="stable"))]

    def request(self, neurons: torch.Tensor, pairs: bool = False) -> Request:
        """neurons: LongTensor [k] of distinct neuron ids, k <= capacity; pairs (`pair_requests` units): distinct pair
        ids of tied halves instead, answered with their records' slots (each counted as both its halves)."""
        s = self.store
        if s.closed:
            raise SparseforgeError("the neuron store was closed; load the engine again to run it")
        if pairs and not self.pair_requests:
            raise ValueError("request(pairs=True) needs an arena of pair records (unit.pair_requests)")
        ids = neurons.numpy().astype(np.int64, copy=False)
        k, w = ids.size, 2 if pairs else 1  # a pair id (< keys) is its record's key and the kernels' name of its slot; it counts as both halves
        if k > self.capacity:
            raise ValueError(f"request for {k} neurons exceeds the unit's capacity {self.capacity}; split it into chunks")
        s.clock, c = s.clock + 1, self.counts
        c["requests"], c["neurons"] = c["requests"] + 1, c["neurons"] + w * k
        keys = self._key(ids)
        slots = self.slot_of[keys]
        cached = slots >= s.pool_start
        held = slots[cached]  # cached slots to pin; a pair's may come twice: an index assignment changes it once, pinning and unpinning alike
        resident = slots >= 0
        n_resident = int(np.count_nonzero(resident))
        c["hot_hits"] += w * (n_resident - held.size)
        c["cache_hits"], c["misses"] = c["cache_hits"] + w * held.size, c["misses"] + w * (k - n_resident)
        if held.size:
            s.pins[held] += 1
            s.last_use[held] = s.clock
        if n_resident == k and not s.loading[held].any():  # every neuron resident, no read in flight: nothing to wait for
            named = torch.from_numpy(self._named(ids, slots))
            return Request(neurons, named, None, lambda: self._unpin(held, [])) if held.size else Request(neurons, named)  # all hot: nothing pinned
        late = cached & s.loading[np.maximum(slots, 0)]  # cached, but an earlier request's read is still running
        ready = resident & ~late
        missing = ~resident
        job = self._load(np.unique(keys[missing])) if missing.any() else None
        any_late = bool(late.any())
        waits = [j for j in self.jobs if not j.done.is_set()] if any_late else ([job] if job else [])
        pinned = np.concatenate([held, job.slots]) if job else held
        ready_n, ready_s = torch.from_numpy(ids[ready]), torch.from_numpy(self._named(ids[ready], slots[ready]))
        if not waits:
            return Request(ready_n, ready_s, None, lambda: self._unpin(pinned, []))
        rest_n = ids[late | missing]
        rest_s = self._named(rest_n, self.slot_of[keys[late | missing]])  # the missing ones' slots were claimed by _load
        if job:  # queued last: the reader thread's Python then runs while the engine is in a kernel, not contending for the GIL here
            s.submit(job)
        return Request(ready_n, ready_s, lambda: self._wait(waits, rest_n, rest_s), lambda: self._unpin(pinned, waits))

    def _named(self, neurons: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The kernels' names of neurons in their slots: in an arena of S pair records, a second half's is S + slot."""
        return slots + self.store.slots * (neurons >= self.keys) if self.records else slots

    def stats(self) -> dict:
        """Counters since load, and the unit's hot neurons and capacity (resident bytes: the store's stats)."""
        return {**self.counts, "hot": self.hot, "capacity": self.capacity}

    # ---------------------------------------------------------------- cache mechanics

    def _load(self, neurons: np.ndarray) -> ReadJob:
        """Claim pool slots for `neurons` (slot keys: pairs in an arena of pair records; LRU victims among unpinned
        slots, of any unit): their read job, for request() to queue."""
        s, m = self.store, neurons.size
        p0 = s.pool_start
        free = s.pins[p0:] == 0
        n_free = int(np.count_nonzero(free))
        if m > n_free:
            raise ValueError(f"request needs {m} cache slots, {n_free} are free (capacity {self.capacity}); "
                             "release earlier requests first")  # fmt: skip
        key = s.last_use[p0:].copy()
        key[s.owner[p0:] < 0] = -1  # empty slots first
        key[~free] = np.iinfo(np.int64).max
        victims = (np.argpartition(key, m - 1)[:m] if m < key.size else np.arange(key.size)) + p0
        owners = s.owner[victims]
        for o in np.unique(owners[owners >= 0]).tolist():  # evicted neurons leave their units
            s.units[o].slot_of[s.neuron_in[victims[owners == o]]] = -1
        self.counts["evictions"] += int(np.count_nonzero(owners >= 0))
        self.slot_of[neurons] = victims
        s.neuron_in[victims], s.owner[victims] = neurons, self.index
        s.pins[victims] += 1
        s.last_use[victims] = s.clock
        s.loading[victims] = True
        job = ReadJob(self, neurons, victims)
        self.jobs = [j for j in self.jobs if not j.done.is_set()] + [job]
        return job

    def _wait(self, jobs: list[ReadJob], neurons: np.ndarray, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        for job in jobs:
            job.done.wait()
        self.store.wait_seconds += time.perf_counter() - start
        for job in jobs:
            if job.error is not None:
                self._forget(job)
                raise job.error
        return torch.from_numpy(neurons), torch.from_numpy(slots)

    def _unpin(self, pinned: np.ndarray, jobs: list[ReadJob]) -> None:
        for job in jobs:  # no read may still write into a slot once it can be evicted
            job.done.wait()
            if job.error is not None:
                self._forget(job)
        self.store.pins[pinned] -= 1

    def _forget(self, job: ReadJob) -> None:
        """A failed read left its slots without data: mark them empty."""
        s = self.store
        live = (s.owner[job.slots] == self.index) & (s.neuron_in[job.slots] == job.neurons)
        self.slot_of[job.neurons[live]] = -1
        s.neuron_in[job.slots[live]], s.owner[job.slots[live]] = -1, -1

    def _run(self, job: ReadJob) -> None:
        """Reader thread: read a job's records, fill its slots, count the bytes."""
        positions = self.position[job.neurons]
        result = self.store.file.read(self.layer, self.expert, positions)
        self.store.fill(job.slots, result, self._halves(job.neurons))
        c = self.counts
        records = np.unique(positions).size if self.pairs else positions.size  # both halves of a pair in two slots: one record
        c["bytes_read"] += result.bytes_read
        c["records_read"] += records
        c["record_bytes"] += records * self.record_bytes
        c["reads"] += result.reads

    def _halves(self, neurons: np.ndarray) -> np.ndarray | None:
        """For a unit of pair records scattered to bundle slots: which half of its pair each neuron is (bool [n]), else None."""
        return neurons >= self.intermediate // 2 if self.pairs else None
