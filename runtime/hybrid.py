"""The hybrid tier: attention, norms, embeddings, the lm_head, the KV cache and each layer's hot MLP neurons on a
fast device (a GPU, or the CPU itself), the cold neurons on the CPU where they sit; only activations cross.

    engine = Engine.load(ckpt, mode="sparse", device="cuda", device_memory="6GB")   # or "25%", "100%"

A placement plan made for the device budget (runtime/plan.py, reserving the always-touched weights and the KV cache
but not the predictors or the head screen, which stay on the CPU with the cold neurons) names each layer's hot
neurons. Each MLP becomes a `SplitUnit`: the hot neurons as two dense matrices on the device (gate and up rows
stacked [2h, H], down columns [H, h]; on a checkpoint of tied halves whole pairs, each pair's one gate and one up row,
so a hot pair costs four rows, not six), computed in full for every row, so the hot part is exact whatever the mode; and
the cold neurons' bundles on the CPU (pair records where they are whole pairs of tied halves), served through the units contract (runtime/units.py) to runtime/mlp.py, which
computes the cold part in the engine's mode (the predictor's, the screen's or all cold neurons) with the native
kernels. Per layer (`HybridMLP`): the normed MLP input and the residual are copied to the CPU, the device's part is
queued, the CPU computes the cold part meanwhile (a CUDA device runs its queue while the CPU works), and both are
added into the residual on the device. A layer without cold neurons makes no copy, so a fully resident model decodes
with no host round trip inside a step. On CUDA a batch-1 decode step runs as replayed CUDA graphs (runtime/graphs.py).

Below the CPU, the disk tier stays available: with `fast_memory` too (runtime/engine.py open_engine) the cold
neurons come from a neuron store (runtime/store.py) whose plan ranks the device's neurons last (`cpu_plan`), so
they are neither pinned in CPU memory nor read from disk. With `device="cpu"` the same code runs with the fast tier on
the CPU (PyTorch ops for the device's part): what the tests pin against the dense forward. MoE checkpoints are refused.
"""

import time
from dataclasses import dataclass

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.units import Request, convert_bundles, make_bundles, pair_records, tied_bundles
from sparseforge.runtime.weights import WEIGHT_DTYPES, Linear, convert


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:1' | 'mps' -> a torch.device that exists here, or a one-line error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SparseforgeError(f"--device {device!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SparseforgeError(f"--device {device} but this PyTorch sees no CUDA device (torch {torch.__version__}); "
                                   "install a CUDA build of torch or use --device cpu")  # fmt: skip
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SparseforgeError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise SparseforgeError(f"--device {device} but MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise SparseforgeError(f"--device {device}: the hybrid tier supports cpu, cuda and mps")
    return dev


def device_plan(ckpt, device_memory: str, weight_dtype: str, context: int, kv_dtype: str = "float32") -> dict:
    """The placement plan of the device: its budget (a --fast-memory size: "6GB", "25%" of the MLP bytes on top of the
    reserve) holds attention, embeddings, lm_head, norms and the KV cache, then the most frequent neurons (on a
    checkpoint of tied halves, the most frequent pairs, each held whole: plan["tied_pairs"])."""
    from sparseforge.checkpoint import load_config
    from sparseforge.runtime.plan import PlanRequest, make_plan
    from sparseforge.runtime.sizes import parse_size

    try:
        size = parse_size(device_memory)
    except SparseforgeError as e:
        raise SparseforgeError(str(e).replace("--fast-memory", "--device-memory")) from None
    tied = bool((load_config(ckpt).sparsity or {}).get("tied_halves"))  # hot pairs held whole (SplitUnits)
    try:
        return make_plan(ckpt, PlanRequest(size, context=context, dtype=weight_dtype, predictors=False, head_screen=False, kv_dtype=kv_dtype,
                                           tied=tied))  # fmt: skip
    except SparseforgeError as e:
        raise SparseforgeError(str(e).replace("--fast-memory", "--device-memory")) from None


def cpu_plan(ckpt, fast_memory: str, device_memory: str | None, weight_dtype: str, context: int, predictor_dtype: str | None,
             kv_dtype: str = "float32", mode: str = "sparse") -> dict:
    """The neuron store's plan under a hybrid engine: `fast_memory` of CPU memory for the neurons the device does not
    hold (theirs ranked first by frequency, the device's last), counted as the CPU engine counts it, for the engine's
    `mode` (the predictors' or the screens' reserve: runtime/plan.py PlanRequest)."""
    from sparseforge.runtime.plan import PlanRequest, make_plan
    from sparseforge.runtime.sizes import parse_size

    exclude = device_hot(device_plan(ckpt, device_memory or "100%", weight_dtype, context, kv_dtype))
    request = PlanRequest(parse_size(fast_memory), context=context, dtype=weight_dtype, predictor_dtype=predictor_dtype, head_screen=False,
                          kv_dtype=kv_dtype, mode=mode, hybrid=True)
    return make_plan(ckpt, request, exclude=exclude)


class ColdBundles:
    """The CPU's part of a unit when every cold neuron is in memory, requested by neuron id (runtime/units.py's
    contract). When the cold neurons are whole pairs of tied halves (j and I/2 + j both cold, checked on the bundles as
    stored: runtime/units.py tied_bundles), as a device plan of tied pairs leaves them, they are held as pair records
    [P, 4, H] (`records`: runtime/units.py pair_records, two thirds of the halves' bundles), pair j's first half named
    p and its second P + p, as the kernels list halves of pair records; each listed pair is computed from its one gate
    and one up row. Else their bundles [c, 3, H] in slots 0..c-1 (the order of `cold_ids`), and `pairs` says the pairs
    with both halves cold are tied halves, which runtime/mlp.py computes from one gate and one up row each."""

    local = None  # the SplitUnit around it says which neurons are its
    tied = False  # only the cold neurons are held

    def __init__(self, layer: int, expert: int, cold_ids: torch.Tensor, bundles: torch.Tensor, scales, channels, intermediate: int):
        self.layer, self.expert, self.channels = layer, expert, channels
        self.intermediate, self.hidden = intermediate, bundles.shape[-1]
        self.capacity = max(int(cold_ids.numel()), 1)
        slot = torch.full((intermediate,), -1, dtype=torch.long)  # [I] a neuron's slot (its kernel name over pair records), -1: the device's
        slot[cold_ids] = torch.arange(cold_ids.numel())
        half = intermediate // 2
        first, second = slot[:half], slot[half : 2 * half]
        both = (first >= 0) & (second >= 0)
        whole = [None if t is None else torch.cat([t[first[both]], t[second[both]]]) for t in (bundles, scales)]  # the whole pairs' bundles
        tied = intermediate % 2 == 0 and bool(both.any()) and tied_bundles(*whole)
        self.records = tied and 2 * int(both.sum()) == cold_ids.numel()  # every cold neuron in a whole pair
        self.pairs = tied and not self.records  # tied halves in two bundle slots (MLPUnit.pairs)
        if self.records:
            pairs = both.nonzero().flatten()  # ascending j: record p holds pair pairs[p]
            bundles, scales = pair_records(*whole)
            slot[pairs], slot[pairs + half] = torch.arange(pairs.numel()), pairs.numel() + torch.arange(pairs.numel())
        self.fixed_slots, self.bundles, self.scales = slot, bundles, scales

    def request(self, neurons: torch.Tensor) -> Request:
        return Request(ready_neurons=neurons, ready_slots=self.fixed_slots[neurons])

    def order(self, neurons: torch.Tensor) -> torch.Tensor:
        return neurons


class SplitUnit:
    """One MLP split between the fast device (hot neurons, dense matrices) and the CPU (the cold neurons).

    As an MLP unit (runtime/units.py) it serves the cold part through `inner`: ColdBundles, or a unit of the neuron
    store (runtime/store.py) when the cold neurons live on disk below a RAM budget. `local` [I] (bool) and `local_ids`
    mark the cold ones, so runtime/mlp.py requests and computes on the CPU only the cold neurons it selects.
    `gate_up` [2h, H] and `down` [H, h] are the hot part (Linear, on the device); with `hot_pairs` the h hot neurons
    are h/2 whole tied pairs: `gate_up` holds each pair's one gate and one up row [h, H] and `down` the first halves'
    columns, then the second halves' [H, h]."""

    def __init__(self, hot: torch.Tensor, gate_up: Linear, down: Linear, inner, hot_pairs: bool = False):
        self.hot, self.gate_up, self.down, self.inner, self.hot_pairs = hot, gate_up, down, inner, hot_pairs
        self.layer, self.expert, self.intermediate, self.hidden = inner.layer, inner.expert, inner.intermediate, inner.hidden
        self.tied = False  # part of the MLP is on the device
        self.pair_requests = False  # requests name the CPU's neurons (`local`)
        self.local = torch.ones(self.intermediate, dtype=torch.bool)
        self.local[hot] = False
        self.local_ids = self.local.nonzero().flatten()

    @property
    def bundles(self) -> torch.Tensor:
        return self.inner.bundles

    @property
    def scales(self) -> torch.Tensor | None:
        return self.inner.scales

    @property
    def channels(self) -> torch.Tensor | None:
        return self.inner.channels

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def fixed_slots(self) -> torch.Tensor | None:
        return self.inner.fixed_slots

    @property
    def pairs(self) -> bool:
        return self.inner.pairs

    def request(self, neurons: torch.Tensor) -> Request:
        return self.inner.request(neurons)

    def order(self, neurons: torch.Tensor) -> torch.Tensor:
        return self.inner.order(neurons)

    @property
    def device_bytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def device_hot(plan: dict) -> dict[int, list[int]]:
    """{layer: the device plan's hot neuron ids, ascending}."""
    return {row["layer"]: sorted(row["hot"]) for row in plan["layers"]}


class SplitUnits:
    """The units factory (runtime/weights.py) of a hybrid engine: each unit's plan-hot neurons on `device`, the rest
    as CPU bundles in the reader's weight dtype, or through `store` (a NeuronStore whose plan leaves the device's
    neurons out: runtime/store.py) when the cold neurons live on disk."""

    def __init__(self, plan: dict, device: torch.device, threads: int, native: bool, store=None):
        if plan["num_experts"] != 1:
            raise SparseforgeError(f"the checkpoint has {plan['num_experts']} experts per layer; the hybrid device tier supports dense MLPs "
                                   "only: run it without --device (CPU engine, with --fast-memory for the disk tier)")  # fmt: skip
        self.hot_of, self.device, self.threads, self.native = device_hot(plan), device, threads, native
        self.store = None if store is None or store.resident else store  # a store whose plan holds every neuron: the CPU part in memory
        self.hot_pairs = bool(plan.get("tied_pairs"))  # the plan holds whole tied pairs (device_plan)
        self.plan = None if store is None else store.plan  # what the engine checks its CPU reserve against

    def __call__(self, layer: int, expert: int, reader) -> SplitUnit:
        gate, up, down = reader.mlp(layer, expert)
        hot = torch.tensor(self.hot_of[layer], dtype=torch.long)
        linear = (lambda w: _device_linear(w, reader.weight_dtype, self.device, self.threads, self.native))  # fmt: skip
        rows = _hot_pairs(layer, hot, gate, up) if self.hot_pairs else hot  # the gate and up rows the device holds
        gate_up, down_hot = linear(torch.cat([gate[rows], up[rows]])), linear(down[:, hot])
        if self.store is not None:
            return SplitUnit(hot, gate_up, down_hot, self.store(layer, expert, reader), self.hot_pairs)
        cold = torch.ones(gate.shape[0], dtype=torch.bool)
        cold[hot] = False
        ids = cold.nonzero().flatten()
        parts = convert_bundles(make_bundles(gate[ids], up[ids], down[:, ids]), WEIGHT_DTYPES[reader.weight_dtype])
        return SplitUnit(hot, gate_up, down_hot, ColdBundles(layer, expert, ids, *parts, gate.shape[0]), self.hot_pairs)

    def stats(self) -> dict:
        """The neuron store's counters (runtime/store.py), when the cold neurons live on disk."""
        return self.store.stats() if self.store is not None else {}


def _hot_pairs(layer: int, hot: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The first halves of a tied plan's hot neurons `hot` (ascending), checked to be whole pairs of tied halves."""
    half = gate.shape[0] // 2
    firsts = hot[hot < half]
    if not torch.equal(hot[hot >= half], firsts + half):
        raise SparseforgeError(f"layer {layer}: the device plan holds tied pairs but its hot neurons are not whole pairs; "
                               "make the plan again with this sparseforge (device_plan)")  # fmt: skip
    if not (torch.equal(gate[firsts], gate[firsts + half]) and torch.equal(up[firsts], -up[firsts + half])):
        raise SparseforgeError(f"layer {layer}: config.json says tied_halves but the hot pairs' gate and up rows are not tied; "
                               "set sparsity.tied_halves to false in config.json (or re-save the checkpoint with sparseforge train)")
    return firsts


def _device_linear(w: torch.Tensor, weight_dtype: str, device: torch.device, threads: int, native: bool) -> Linear:
    """A hot matrix on the device; on the CPU as the CPU engine runs its matrices (runtime/weights.py Linear)."""
    weight, scales = convert(w, weight_dtype)
    return Linear(weight.to(device), None if scales is None else scales.to(device), None, threads, native=native and device.type == "cpu")


def move_weights(weights, device: torch.device) -> None:
    """Every non-MLP tensor of runtime/weights.py ModelWeights onto a non-CPU `device`, in place, computed there with
    PyTorch ops (a tied lm_head stays tied)."""
    if device.type == "cpu":
        return
    move = (lambda t: None if t is None else t.to(device))  # fmt: skip
    linear = (lambda m: Linear(move(m.weight), move(m.scales), move(m.bias), m.threads, native=False))  # fmt: skip
    tied = weights.lm_head.weight.data_ptr() == weights.embed.data_ptr()
    weights.embed, weights.embed_scales, weights.final_norm = move(weights.embed), move(weights.embed_scales), move(weights.final_norm)
    weights.lm_head = Linear(weights.embed, weights.embed_scales, None, 1, native=False) if tied else linear(weights.lm_head)
    for lw in weights.layers:
        lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm = (move(t) for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm))
        lw.qkv, lw.o = linear(lw.qkv), linear(lw.o)


@dataclass
class DeviceTier:
    """What a hybrid engine holds on its device: the device, the plan it was made for, the hot neuron count."""

    device: torch.device
    plan: dict

    def stats(self, units: list) -> dict:
        hot = sum(int(u.hot.numel()) for u in units)
        total = sum(u.intermediate for u in units)
        return {"device": str(self.device), "device_memory": self.plan["fast_memory"], "hot_neurons": hot, "neurons": total,
                "hot_fraction": hot / total if total else None, "device_mlp_bytes": sum(u.device_bytes for u in units),
                "expected_hit_rate": self.plan["expected_hit_rate"]}  # fmt: skip


class HybridMLP:
    """`mlp(layer, lw, xn, resid)`: resid += MLP(xn) with the layer's SplitUnit: the hot part on the device, the cold
    part through `cpu_mlp` (runtime/mlp.py SparseMLP) on the CPU (on copies of xn and resid when the device is not it)."""

    def __init__(self, model, meter, cpu_mlp):
        self.model, self.meter, self.cpu_mlp = model, meter, cpu_mlp
        self.device = model.device_tier.device
        meter.device_fired = torch.zeros((), dtype=torch.long, device=self.device)

    def __call__(self, layer: int, lw, xn: torch.Tensor, resid: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        unit = lw.units[0]
        cold = unit.local_ids.numel() > 0
        timed = cold and xn.shape[0] == 1  # a one-token step's split (graphs.py times its own the same way)
        start = time.perf_counter() if timed else 0.0
        if cold and self.device.type == "cpu":  # the CPU's part reads xn and resid before anything is added to resid
            xc, rc = xn, resid
        elif cold:  # the CPU's inputs first: the device's part then runs while the CPU computes
            both = torch.cat([xn, resid]).cpu()  # [2N, H]
            xc, rc = both[: xn.shape[0]], both[xn.shape[0] :]
        y = self._hot(layer, unit, xn) if unit.hot.numel() else None
        if cold:
            mid = time.perf_counter()
            yc = torch.zeros_like(xc)
            self.cpu_mlp(layer, lw, xc, rc, out=yc, exact=exact)
            resid += yc.to(self.device, non_blocking=True)
            if timed:
                self.meter.hybrid_split(start, mid)
        if y is not None:
            resid += y

    def _hot(self, layer: int, unit: SplitUnit, x: torch.Tensor) -> torch.Tensor:
        g, u = unit.gate_up(x).chunk(2, dim=-1)
        act = self.model.activations[layer]
        h = torch.cat([act(g, u), act(g, -u)], dim=-1) if unit.hot_pairs else act(g, u)  # a second half's up row is -u
        self.meter.device_fired += (h != 0).sum()
        self.meter.mlp(h.numel(), h.numel(), 0, unit.device_bytes)
        return unit.down(h)
