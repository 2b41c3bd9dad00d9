"""The MLP of a forward step, through the units (runtime/units.py) or the dense mode's matrices.

Every row's MLP follows the model's mode (runtime/model.py). In the sparse mode the predictor reads the residual
after attention (before the MLP norm). With several rows (prefill, scoring) the union of the rows' predicted neurons
is computed once with PyTorch ops over the gathered bundles and each row's own mask applied, so each row gets
exactly what a one-row sparse step computes. The screen mode chooses neurons the same way with its exact screen of
the normed MLP input (runtime/screen.py) instead of a predictor, for up to SCREEN_ROWS rows (more, as in prefill,
compute every neuron as the oracle mode does: their union keeps most). One row with native kernels: the predictor's
(or screen's) ids, then per part of the unit's request one sf_sparse_mlp call (gate/up dots -> activation -> down
accumulated into the residual). MoE layers touch only the routed experts. A resident unit of tied halves
(runtime/units.py) computes several rows, or one row's every neuron (the oracle mode), a pair at a time: one gate
and one up product give both halves, so a prefill does two thirds of the halves' multiplications and an oracle
decode step reads half the gate and up rows.
"""

import ctypes
import time

import numpy as np
import torch

from sparseforge.predictors.model import either_half, pair_neurons
from sparseforge.runtime import kernels
from sparseforge.runtime.forward import route
from sparseforge.runtime.meter import Meter
from sparseforge.runtime.model import Model
from sparseforge.runtime.screen import SCREEN_ROWS, screen_native, screen_torch
from sparseforge.runtime.units import row_bytes


class SparseMLP:
    """`mlp(layer, lw, xn, resid)`: resid += MLP(xn) for one layer; reports neurons, bytes and predictor time."""

    def __init__(self, model: Model, meter: Meter):
        self.model, self.meter = model, meter
        self._native_predictor = {}  # per (layer, expert): (ids out [I], float scratch [rank + I])
        self._arange = {}
        self._seconds = ctypes.c_double(0.0)  # the fused native call's predictor seconds, accumulated

    def __call__(self, layer: int, lw, xn: torch.Tensor, resid: torch.Tensor, out: torch.Tensor | None = None,
                 exact: torch.Tensor | None = None) -> None:
        """xn: [N, H] normed MLP input; resid: [N, H] the residual, the predictor's input, to which the output is added
        (or to `out` [N, H] when given). exact: bool [N] or None, in the sparse mode the rows to compute with the exact
        mask (a sequence's first position: runtime/step.py first_positions)."""
        out = resid if out is None else out
        if not self.model.moe:
            self._unit(layer, 0, lw, xn, resid, None, out, exact)
            return
        weights, experts = route(lw.router, xn, self.model.top_k)  # [N, k]
        y = torch.zeros_like(resid)  # every expert's predictor reads the residual before any output is added
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            if rows.numel() == xn.shape[0]:  # every row routed here (one row): no gather
                self._unit(layer, e, lw, xn, resid, weights[rows, slot], y, exact)
            else:
                part = torch.zeros(rows.numel(), xn.shape[1])
                self._unit(layer, e, lw, xn[rows], resid[rows], weights[rows, slot], part, None if exact is None else exact[rows])
                y.index_add_(0, rows, part)
        out += y

    def _unit(self, layer: int, expert: int, lw, x: torch.Tensor, resid: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor,
              exact: torch.Tensor | None = None) -> None:
        """out [n, H] += scale [n] * one unit's MLP of x [n, H] (resid: the predictor's input; exact: as __call__'s)."""
        if lw.dense:
            y = self._dense(layer, lw.dense[expert], x)
        elif self.model.native and x.shape[0] == 1 and exact is None:
            self._native_row(layer, expert, lw.units[expert], x[0], resid[0], 1.0 if scale is None else float(scale[0]), out[0])
            return
        else:
            y = self._rows(layer, expert, lw.units[expert], x, resid, exact)
        out += y if scale is None else y * scale[:, None]

    def _dense(self, layer: int, mats, x: torch.Tensor) -> torch.Tensor:
        """Every neuron with plain matmuls: x [n, H] -> [n, H]."""
        gate_up, down = mats
        g, u = gate_up(x).chunk(2, dim=-1)
        h = self.model.activations[layer](g, u)
        self.meter.mlp(h.numel(), h.numel(), int((h != 0).sum()), gate_up.nbytes + down.nbytes)
        return down(h)

    def _native_row(self, layer: int, expert: int, unit, xn: torch.Tensor, resid: torch.Tensor, scale: float, y: torch.Tensor) -> None:
        """y [H] += scale * MLP(xn [H]) over the unit's predicted (sparse) or all (oracle) neurons: predictor, request,
        compute the ready part, wait for the rest, compute it, release."""
        I = unit.intermediate
        mode, neurons = self.model.mode, None
        p = self.model.predictors[(layer, expert)] if mode == "sparse" else None
        if p is not None and unit.fixed_slots is not None:
            self._predict_mlp_row(layer, expert, p, unit, xn, resid, scale, y)
            return
        act, pairs = self.model.activations[layer], False  # pairs: `neurons` lists pairs of tied halves
        if p is not None:
            neurons, pairs = self._predict_row(layer, expert, p, resid, I), p.pairs
        elif mode == "screen":
            neurons, pairs = self._screen_row(layer, expert, xn), self.model.screens[(layer, expert)].tied
        elif unit.pair_requests:  # every pair
            neurons, pairs = self._all_neurons(I // 2), True
        by_pair = pairs and unit.pair_requests  # held as pair records: asked for and computed a pair at a time
        if not by_pair:
            neurons = self._computed(unit, pair_neurons(neurons, I) if pairs else neurons)
        compute = self._pairs if by_pair else self._record_pairs if unit.pairs else self._neurons
        for chunk in unit.order(neurons).split(unit.capacity) if neurons.numel() > unit.capacity else (neurons,):
            req = unit.request(chunk, pairs=True) if by_pair else unit.request(chunk)  # only pair_requests units take pairs
            compute(unit, req.ready_neurons, req.ready_slots, xn, act, y, scale)
            ids, slots = req.wait()
            if slots.numel():
                compute(unit, ids, slots, xn, act, y, scale)
            req.release()
        self.meter.native_mlp(neurons.numel() * (2 if by_pair else 1), _width(unit), row_bytes(unit))

    def _neurons(self, unit, ids: torch.Tensor, slots: torch.Tensor, xn: torch.Tensor, act, y: torch.Tensor, scale: float) -> None:
        """y += scale * MLP(xn) over the neurons at `slots`, one by one."""
        kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, slots, xn, act, y, scale, self.meter.rows_read, self.model.threads)

    def _record_pairs(self, unit, ids: torch.Tensor, slots: torch.Tensor, xn: torch.Tensor, act, y: torch.Tensor, scale: float) -> None:
        """_neurons for a unit of tied halves in any two slots (MLPUnit.pairs): the pairs with both halves among `ids`
        from one gate and one up row, the other neurons one by one."""
        s = slots.numpy()
        firsts, seconds, lone = _whole_pairs(ids.numpy(), unit.intermediate // 2)
        if not firsts.size:
            return self._neurons(unit, ids, slots, xn, act, y, scale)
        threads, counts = self.model.threads, self.meter.rows_read
        kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, torch.from_numpy(s[firsts]), xn, act, y, scale, counts, threads,
                                  second=torch.from_numpy(s[seconds]))  # fmt: skip
        if lone.size:
            kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, torch.from_numpy(s[lone]), xn, act, y, scale, counts, threads)

    def _pairs(self, unit, pairs: torch.Tensor, slots: torch.Tensor, xn: torch.Tensor, act, y: torch.Tensor, scale: float) -> None:
        """_neurons for pairs of tied halves in pair records (`unit.pair_requests`: slots answered to a pair request):
        both halves of each from its record's one gate and one up row."""
        kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, slots, xn, act, y, scale, self.meter.rows_read, self.model.threads, tied=True)

    def _predict_mlp_row(self, layer: int, expert: int, p, unit, xn: torch.Tensor, resid: torch.Tensor, scale: float, y: torch.Tensor) -> None:
        """_native_row's sparse mode with predictor p for a unit whose neurons have fixed slots (a hybrid engine's CPU
        part): predictor and kernel in one native call, no PyTorch op between them."""
        ids, scratch = self._predictor_buffers(layer, expert, p, unit.intermediate)
        before = self._seconds.value
        n = kernels.predict_mlp_native(p.fc1, p.fc2t, p.threshold, resid, unit.fixed_slots, ids, scratch, unit.bundles, unit.scales, unit.channels, xn,
                                       self.model.activations[layer], y, scale, self.meter.rows_read, self._seconds, self.model.threads, p.pairs,
                                       unit.pairs)  # fmt: skip
        self.meter.predictor(self._seconds.value - before)
        self.meter.native_mlp(n, _width(unit), row_bytes(unit))

    def _predict_row(self, layer: int, expert: int, p, resid: torch.Tensor, intermediate: int) -> torch.Tensor:
        """Predicted-active neuron ids of one row with the unit's predictor p."""
        start = time.perf_counter()
        out, scratch = self._predictor_buffers(layer, expert, p, intermediate)
        ids = kernels.predict_native(p.fc1, p.fc2t, p.threshold, resid, out, scratch, self.model.threads)
        self.meter.predictor(time.perf_counter() - start)
        return ids

    def _predictor_buffers(self, layer: int, expert: int, p, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The native predictor's buffers of a unit, made once: ids out [I] (int64) and float32 scratch [rank + I]
        (pair predictors use half of each)."""
        if (layer, expert) not in self._native_predictor:
            self._native_predictor[(layer, expert)] = (torch.empty(intermediate, dtype=torch.long), torch.empty(p.fc1[0].shape[0] + intermediate))
        return self._native_predictor[(layer, expert)]

    def _screen_row(self, layer: int, expert: int, xn: torch.Tensor) -> torch.Tensor:
        """The neurons of one row the unit's screen cannot prove zero (ascending ids); the screen's time and bytes metered."""
        start = time.perf_counter()
        ids, nbytes = screen_native(self.model.screens[(layer, expert)], xn, self.model.threads)
        self.meter.predictor(time.perf_counter() - start)
        self.meter.screen(nbytes)
        return ids

    def _rows(self, layer: int, expert: int, unit, x: torch.Tensor, resid: torch.Tensor, exact: torch.Tensor | None = None) -> torch.Tensor:
        """Several rows (or PyTorch ops): the union of their neurons computed once, each row masked to its own prediction
        (the `exact` rows to every neuron: the exact result)."""
        I = unit.intermediate
        keep = None
        if self.model.mode == "sparse":
            start = time.perf_counter()
            p = self.model.predictors[(layer, expert)]
            keep = torch.ones(x.shape[0], I, dtype=torch.bool) if p is None else p.mask(kernels.predict_torch(p.fc1, p.fc2t, p.threshold, resid))  # [n, I]
            if exact is not None:
                keep[exact] = True
            self.meter.predictor(time.perf_counter() - start)
        elif self.model.mode == "screen" and x.shape[0] <= SCREEN_ROWS:
            start = time.perf_counter()
            keep, nbytes = screen_torch(self.model.screens[(layer, expert)], x)  # [n, I]
            self.meter.predictor(time.perf_counter() - start)
            self.meter.screen(nbytes)
        if keep is not None and unit.local is not None:  # a hybrid split: its hot neurons are computed on the device
            keep = keep & unit.local
        if unit.tied:
            return self._tied_rows(layer, unit, x, keep)
        neurons = self._computed(unit, None) if keep is None else keep.any(0).nonzero().flatten()
        y = torch.zeros_like(x)
        act, fired, rows = self.model.activations[layer], 0, 0
        for chunk in (unit.order(neurons) if neurons.numel() > unit.capacity else neurons).split(unit.capacity):
            req = unit.request(chunk)
            for ids, slots in ((req.ready_neurons, req.ready_slots), req.wait()):
                if ids.numel():
                    for part, h, read in self._parts_torch(unit, ids, slots, x, act, keep):
                        y += part
                        fired, rows = fired + int((h != 0).sum()), rows + read
            req.release()
        computed = int(keep.sum()) if keep is not None else x.shape[0] * neurons.numel()
        self.meter.mlp(computed, x.shape[0] * _width(unit), fired, rows * row_bytes(unit))
        return y

    def _parts_torch(self, unit, ids: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, act, keep: torch.Tensor | None):
        """_rows over neurons `ids` at `slots`: yields (y part [N, H], h, rows read), a unit of tied halves in any two
        slots (MLPUnit.pairs) computing the pairs with both halves among ids from one gate and one up product each, and
        one over pair records (a neuron store's arena: `slots` name halves) each listed pair so."""
        if kernels.mlp_kind(unit.bundles)[0] == kernels.MLP_PAIR_HALVES:
            y, h, pairs = kernels.pair_halves_torch(unit.bundles, unit.scales, unit.channels, slots, x, act, None if keep is None else keep[:, ids])
            yield y, h, 2 * pairs + ids.numel()
            return
        firsts, seconds, lone = _whole_pairs(ids.numpy(), unit.intermediate // 2) if unit.pairs else ((), (), None)
        if len(firsts):
            first, second = torch.from_numpy(firsts), torch.from_numpy(seconds)
            mask = None if keep is None else torch.cat([keep[:, ids[first]], keep[:, ids[second]]], dim=1)
            yield *kernels.tied_mlp_torch(unit.bundles, unit.scales, unit.channels, slots[first], x, act, mask, second=slots[second]), 4 * len(firsts)
            ids, slots = ids[torch.from_numpy(lone)], slots[torch.from_numpy(lone)]
        if ids.numel():
            yield *kernels.sparse_mlp_torch(unit.bundles, unit.scales, unit.channels, slots, x, act, None if keep is None else keep[:, ids]), 3 * ids.numel()

    def _tied_rows(self, layer: int, unit, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """_rows over a resident unit of tied halves: the pairs with a chosen half, one gate and one up product each."""
        half = unit.intermediate // 2
        pairs = self._all_neurons(half) if keep is None else either_half(keep).any(0).nonzero().flatten()
        y, h = kernels.tied_mlp_torch(unit.bundles, unit.scales, unit.channels, pairs, x, self.model.activations[layer],
                                      None if keep is None else torch.cat([keep[:, pairs], keep[:, pairs + half]], dim=1))  # fmt: skip
        computed = int(keep.sum()) if keep is not None else x.shape[0] * unit.intermediate
        self.meter.mlp(computed, x.shape[0] * unit.intermediate, int((h != 0).sum()), 4 * pairs.numel() * row_bytes(unit))
        return y

    def _computed(self, unit, neurons: torch.Tensor | None) -> torch.Tensor:
        """The neurons computed through this unit of those chosen (None: all): its `local` ones (runtime/units.py)."""
        if unit.local is not None:
            return unit.local_ids if neurons is None else neurons[unit.local[neurons]]
        return self._all_neurons(unit.intermediate) if neurons is None else neurons

    def _all_neurons(self, intermediate: int) -> torch.Tensor:
        if intermediate not in self._arange:
            self._arange[intermediate] = torch.arange(intermediate)
        return self._arange[intermediate]


def _width(unit) -> int:
    """The most neurons computed through a unit: all of them, or its `local` ones."""
    return unit.intermediate if unit.local is None else unit.local_ids.numel()


def _whole_pairs(ids: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions in ids (distinct neuron ids) of the pairs with both halves there, j and half + j: (their first halves,
    their second halves, in the same order, ascending by j), and of the other ids."""
    first = ids < half
    f, s = np.flatnonzero(first), np.flatnonzero(~first)
    _, a, b = np.intersect1d(ids[f], ids[s] - half, assume_unique=True, return_indices=True)
    lone = np.ones(ids.size, dtype=bool)
    lone[f[a]], lone[s[b]] = False, False
    return f[a], s[b], np.flatnonzero(lone)
