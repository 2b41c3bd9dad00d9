"""The two-tier neuron store: hot neurons pinned in memory, cold ones read from the bundle file into an LRU neuron cache
by a background thread while the engine computes the resident ones.

    store = tiered_units(ckpt, "plan-25pct.json", "float32")   # or a plan dict, or a size: "25%", "400MiB"
    engine = Engine.load(ckpt, mode="sparse", weight_dtype="float32", units=store)
    ...; store.stats(); store.close()

`store` is the engine's units factory (`store(layer, expert, reader) -> TieredUnit`, runtime/weights.py and
runtime/tiered.py). All units
share one arena of slots (`store.bundles`, every unit's `bundles`): each unit's hot neurons in a range of their own
(pinned, loaded once at startup), then one pool of cache slots shared by every unit, an LRU cache of cold neurons.
`request(neurons)` returns the hot and cached neurons as ready at once, claims pool slots for the misses (free ones
first, then the least recently used slots no open request holds, whichever unit's neuron they hold) and queues their
read on the store's reader thread; `wait()` blocks until they are in, `release()` lets the slots be evicted again.

A bundle file of pair records (tied halves with pair predictors: runtime/bundles.py) fills an arena of pair records
`[S, 4, H]`: a slot holds a pair, requested as a pair (`request(pairs, pairs=True)`: a tied screen's or pair
predictors' lists) or by whichever of its halves a request names (slot s the first half, S + s the second, as the
kernels list neurons of pair records), so a budget holds 1.5x the halves of bundles and each pair is computed from its
one gate and one up row. Any other file fills an arena of bundles `[S, 3, H]`, a pair's halves in two slots.

How the plan's fast memory is shared out (docs/runtime.md "Neuron store"): the MLP budget holds `mlp.budget_bytes // b`
neurons, b a slot's bytes per neuron (a bundle; half a pair record). A fraction `cache_fraction` of them (at least
`min_cold_slots` slots) becomes the pool; the rest stay hot: the globally most frequent of the plan's hot neurons, as
the plan's optimality argument asks. One pool rather than one cache per unit: decode computes one layer at a time, so
the layer at hand can hold all its misses in one request (one read job per layer instead of a dozen). Resident MLP
bytes = arena slots x slot bytes <= mlp.budget_bytes, checked. A token whose predicted neurons exceed a unit's
`capacity` is computed in chunks in file order (`unit.position[neurons]`), so each chunk's misses are a few long reads.
A plan that holds every neuron (`store.resident`) needs no slots: the store hands out the resident engine's units, whose
decode step is one native call (runtime/decode.py LeanStep), starts no reader thread and, where the plan's own bytes a
neuron say so, neither builds nor opens the bundle file.
"""

import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.bundles import MERGE_GAP, BundleFile, ensure_bundles
from sparseforge.runtime.pages import huge_empty
from sparseforge.runtime.plan import PlanRequest, holds_every_neuron, hot_counts, load_plan, make_plan, placement_ranks
from sparseforge.runtime.sizes import human_bytes, parse_size
from sparseforge.runtime.tiered import COUNTERS, ReadJob, TieredUnit
from sparseforge.runtime.units import MLPUnit
from sparseforge.runtime.weights import WEIGHT_DTYPES, WeightReader, resident_unit


class NeuronStore:
    """The units factory of a disk-backed engine run: the bundle file, the arena of slots and the reader thread. The arena
    is one [S, 3, H] tensor of bundles or [S, 4, H] of pair records (int8: with [S, 3] or [S, 4] scales) that every unit's
    `bundles` points at: each unit's hot neurons (pairs) in a range of their own, then `pool_slots` cache slots shared by
    all units. pair_slots False: each half of a pair record in a bundle slot of its own (benchmarks/budget.py compares)."""

    def __init__(self, ckpt: str | Path, plan: dict, weight_dtype: str, cache_fraction: float = 0.2, min_cold_slots: int = 16,
                 io: str = "direct", verify: str = "once", merge_gap: int = MERGE_GAP, build: bool = True, progress: bool = True,
                 pair_slots: bool = True):  # fmt: skip
        if plan["dtype"] != weight_dtype:
            raise SparseforgeError(f"the plan was made for dtype {plan['dtype']}, the engine runs {weight_dtype}; make a plan "
                                   f"with sparseforge plan CKPT --fast-memory {plan['fast_memory']} --dtype {weight_dtype}")  # fmt: skip
        if not 0.0 <= cache_fraction <= 1.0 or min_cold_slots < 1:
            raise SparseforgeError(f"cache_fraction {cache_fraction} must be in [0, 1] and min_cold_slots {min_cold_slots} >= 1")
        self.ckpt, self.plan, self.weight_dtype = Path(ckpt), plan, weight_dtype
        self.file: BundleFile | None = None
        # every neuron fits at the plan's bytes a neuron (a pair record's half for tied halves): the resident engine's
        # units hold them in no more, so no bundle file is built or opened
        self.per_neuron, self.records = plan["bytes_per_neuron"], bool(plan.get("tied_pairs"))
        if pair_slots and holds_every_neuron(plan):
            self.hot, pool = split_slots(plan, self.ckpt, cache_fraction, min_cold_slots, self.per_neuron)  # all hot, no pool
        else:
            self.file = ensure_bundles(ckpt, weight_dtype, build=build, progress=progress, io=io, verify=verify, merge_gap=merge_gap)
            self.records = pair_slots and all(self.file.pairs(*key) for key in self.file.unit_rows)  # an arena of pair records (module docstring)
            per_slot = 2 if self.records else 1
            self.per_neuron = (self.file.record_bytes(0, 0) if self.records else self.file.record) // per_slot  # a slot's bytes per neuron
            self.hot, pool = split_slots(plan, self.ckpt, cache_fraction, min_cold_slots, self.per_neuron, self.records)
        rows, self.per_slot = (4, 2) if self.records else (3, 1)  # rows and neurons a slot holds
        self.pool_slots = pool // self.per_slot
        self.offsets, at = {}, 0  # (layer, expert) -> (unit index, first arena slot of its hot range)
        for index, (key, ids) in enumerate(self.hot.items()):  # the units' hot ranges in key order, then the pool
            self.offsets[key], at = (index, at), at + int(ids.numel()) // self.per_slot
        self.pool_start = at
        self.resident = pool == 0  # the plan holds every neuron: the resident engine's units, no arena, no reader thread
        self.slots = n = 0 if self.resident else at + self.pool_slots
        self.bundles = self.scales = None
        if not self.resident:
            with torch.inference_mode(False):  # normal tensors: the reader thread writes them outside inference mode
                self.bundles = huge_empty((n, rows, self.file.hidden), WEIGHT_DTYPES[self.file.dtype])  # rows read scattered
                self.scales = torch.empty(n, rows, dtype=torch.float32) if self.file.dtype == "int8" else None
        self.neuron_in = np.full(n, -1, dtype=np.int64)  # [S] slot -> neuron id of its owner unit, -1 empty
        self.owner = np.full(n, -1, dtype=np.int64)  # [S] slot -> index of the unit whose neuron it holds
        self.pins = np.zeros(n, dtype=np.int64)  # open requests holding each slot
        self.last_use = np.zeros(n, dtype=np.int64)  # LRU clock per slot
        self.loading = np.zeros(n, dtype=bool)  # a queued read will fill the slot
        self.clock = 0
        self.units: list[MLPUnit | None] = [None] * len(self.hot)  # by unit index, as `owner` names them
        self.wait_seconds = 0.0
        self.io_seconds = 0.0
        self.closed = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = None if self.resident else threading.Thread(target=self._reader, name="sparseforge-neuron-reader", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def __call__(self, layer: int, expert: int, reader=None) -> MLPUnit:
        """The engine's units factory (runtime/weights.py): the unit's hot bundles are read now; under a plan that
        holds every neuron, the resident engine's unit (runtime/weights.py resident_unit), which its decode step runs
        as one native call."""
        if reader is not None and reader.weight_dtype != self.weight_dtype:
            raise SparseforgeError(f"the neuron store holds {self.weight_dtype} bundles, the engine loads {reader.weight_dtype}; "
                                   "pass the same weight_dtype to tiered_units and Engine.load")  # fmt: skip
        index, offset = self.offsets[(layer, expert)]
        if self.resident:
            unit = resident_unit(layer, expert, reader or WeightReader(self.ckpt, self.weight_dtype))
            held = sum(t.numel() * t.element_size() for t in (unit.bundles, unit.scales) if t is not None)
            if held > unit.intermediate * self.per_neuron:
                raise SparseforgeError(f"layer {layer}'s MLP takes {held} B in memory, the plan for {self.plan['fast_memory']} counted "
                                       f"{self.per_neuron} B a neuron ({unit.intermediate * self.per_neuron} B); make the plan again: "
                                       f"sparseforge plan {self.ckpt} --fast-memory {self.plan['fast_memory']} --dtype {self.weight_dtype}")  # fmt: skip
        else:
            unit = TieredUnit(self, layer, expert, index, offset, self.hot[(layer, expert)])
        self.units[index] = unit
        return unit

    def fill(self, slots: np.ndarray, result, halves: np.ndarray | None = None) -> None:
        """Copy read records into arena slots (halves: pair records, BundleFile.scatter)."""
        self.file.scatter(result.records, slots, self.bundles, self.scales, halves)

    def submit(self, job: ReadJob) -> None:
        self._queue.put(job)

    def _reader(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                job.unit._run(job)
                self.loading[job.slots] = False
            except BaseException as e:  # handed to the engine thread by wait()
                job.error = e
            finally:
                self.io_seconds += time.perf_counter() - start
                job.done.set()

    def loaded(self) -> list[MLPUnit]:
        """The units the engine has asked for so far."""
        return [u for u in self.units if u is not None]

    def resident_bytes(self) -> int:
        """Bytes of the arena's slots and row scales (resident units: theirs)."""
        held = [(u.bundles, u.scales) for u in self.loaded()] if self.resident else [(self.bundles, self.scales)]
        return sum(t.numel() * t.element_size() for pair in held for t in pair if t is not None)

    def stats(self) -> dict:
        """Counters summed over units, hit rate, resident bytes against the plan's MLP budget, the I/O mode."""
        total = dict.fromkeys(COUNTERS, 0)
        for unit in [] if self.resident else self.loaded():
            for k in COUNTERS:
                total[k] += unit.counts[k]
        n = max(total["neurons"], 1)
        hot = 1.0 if self.resident else total["hot_hits"] / n  # resident units: every neuron a hit, no requests counted
        return {
            **total,
            "resident": self.resident,
            "hit_rate": hot + total["cache_hits"] / n,
            "hot_hit_rate": hot,
            "cache_hit_rate": total["cache_hits"] / n,
            "resident_bytes": self.resident_bytes(),
            "mlp_budget_bytes": self.plan["mlp"]["budget_bytes"],
            "hot_neurons": sum(int(h.numel()) for h in self.hot.values()), "hot_slots": self.pool_start,
            "cache_slots": self.pool_slots, "slot_bytes": self.per_neuron * self.per_slot,
            "load_bytes": self.resident_bytes() if self.resident else sum(u.load_bytes for u in self.loaded()),
            "io": self.file.io if self.file else None, "wait_seconds": self.wait_seconds, "io_seconds": self.io_seconds,
        }

    def close(self) -> None:
        """Stop the reader thread (after the reads already queued) and close the file; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> "NeuronStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_slots(plan: dict, ckpt: Path, cache_fraction: float, min_cold_slots: int, per_neuron: int, pairs: bool = False) -> tuple[dict, int]:
    """Share the plan's MLP budget between hot neurons and the shared pool of cache slots (module docstring), at
    `per_neuron` bytes a neuron; pairs: a slot holds a pair record, so hot neurons are whole pairs and the pool even.
    Returns ({(layer, expert): hot neuron ids [h_u], most frequent first}, pool size in neurons)."""
    from sparseforge.predictors.profile import load_profile

    counts, ranked_by = placement_ranks(ckpt, load_profile(ckpt)[0]["counts"])  # [L, E, I], as the plan ranked them
    for layer, ids in plan.get("excluded", {}).items():  # neurons held elsewhere (a hybrid engine's device) rank last
        counts[int(layer), 0, ids] = -1
    layers, experts, width = counts.shape
    if (len(plan["layers"]), plan["num_experts"], plan["intermediate_size"]) != (layers, experts, width):
        raise SparseforgeError(f"the plan for {plan['fast_memory']} places {len(plan['layers'])} layers x {plan['num_experts']} experts x "
                               f"{plan['intermediate_size']} neurons, the checkpoint's profile counts {layers} x {experts} x {width}; "
                               f"make the plan again: sparseforge plan {ckpt} --fast-memory {plan['fast_memory']}")  # fmt: skip
    keys = [(i, e) for i in range(layers) for e in range(experts)]
    plan_hot = {}
    for row in plan["layers"]:
        for ex in row.get("experts", [{"expert": 0, "hot": row.get("hot", [])}]):
            plan_hot[(row["layer"], ex["expert"])] = torch.tensor(ex["hot"], dtype=torch.long)
    if holds_every_neuron(plan, per_neuron):  # all hot, no cache
        return {k: plan_hot[k] for k in keys}, 0
    total = plan["mlp"]["budget_bytes"] // per_neuron
    least = 2 * min(min_cold_slots, width // 2) if pairs else min(min_cold_slots, width)
    total -= total % 2 if pairs else 0
    if total < least:
        need = plan["always_touched"]["total"] + least * per_neuron
        raise SparseforgeError(
            f"fast memory {plan['fast_memory']} ({plan['budget_bytes']} B) leaves room for {total} neuron bundles; the neuron "
            f"store needs at least {least} cache slots: a minimum of {need} B ({human_bytes(need)}); "
            f"pass --fast-memory {-(-need // 2**20)}MiB or more"
        )
    pool = max(least, round(cache_fraction * total))
    pool += (total - pool) % 2 if ranked_by == "pair frequency" or pairs else 0  # hot pairs whole
    plan_hot = {k: h[torch.argsort(counts[k][h], descending=True, stable=True)] for k, h in plan_hot.items()}  # highest rank first
    ks = hot_counts([counts[k][plan_hot[k]] for k in keys], total - pool)
    hot = {k: plan_hot[k][:n] for k, n in zip(keys, ks)}
    assert sum(len(h) for h in hot.values()) + pool <= total, (hot, pool, total)
    for (layer, _), h in hot.items() if pairs else ():
        if np.unique(h.numpy() % (width // 2)).size * 2 != h.numel():
            raise SparseforgeError(f"the plan for {plan['fast_memory']} holds single halves of tied pairs hot in layer {layer}; the neuron store "
                                   f"holds pairs whole: make the plan again: sparseforge plan {ckpt} --fast-memory {plan['fast_memory']}")  # fmt: skip
    return hot, pool


def tiered_units(ckpt: str | Path, plan: dict | str, weight_dtype: str, context: int = 2048, predictor_dtype: str | None = None,
                 head_screen: bool = True, kv_dtype: str = "float32", mode: str = "sparse", **options) -> NeuronStore:  # fmt: skip
    """The disk-backed units factory for `Engine.load(..., units=...)`.

    plan: a plan dict, a plan file name in the checkpoint ("plan-25pct.json"), or a --fast-memory size ("25%",
    "400MiB") for which a plan is made now (for `weight_dtype`, `context`, `kv_dtype`, the engine `mode` (PlanRequest's)
    and `predictor_dtype`, default `weight_dtype`; head_screen False: no reserve for the lm_head's screen). options:
    NeuronStore's (cache_fraction, min_cold_slots, io, verify, merge_gap, build, progress, pair_slots)."""
    if isinstance(plan, str):
        if plan.endswith(".json"):
            plan = load_plan(ckpt, plan)
        else:
            plan = make_plan(ckpt, PlanRequest(parse_size(plan), context=context, dtype=weight_dtype, predictor_dtype=predictor_dtype,
                                               head_screen=head_screen, kv_dtype=kv_dtype, mode=mode))  # fmt: skip
    return NeuronStore(ckpt, plan, weight_dtype, **options)
