"""The contract between the decode engine and where MLP weights live: an MLP *unit* holds its neurons as
*bundles* in *slots*.

A unit is one MLP: layer `i` of a dense model, or expert `e` of layer `i` of an MoE model. Neuron `j`'s
bundle is what computing it needs: gate row `gate_proj.weight[j, :]`, up row `up_proj.weight[j, :]` and down
column `down_proj.weight[:, j]`, stored together as `bundles[s] = [gate_j; up_j; down_j]` ([3, H]) in some
slot `s`. Kernels read `bundles[slots]`; they never see where a slot's contents came from.

The engine asks a unit for the neurons it is about to compute:

    req = unit.request(neurons)            # LongTensor [k] of neuron ids, k <= unit.capacity
    compute(req.ready_neurons, req.ready_slots)   # resident now: compute while the rest loads
    neurons, slots = req.wait()            # the rest, resident once this returns (I/O overlapped above)
    compute(neurons, slots)
    req.release()                          # the request's slots may be evicted from here on

`unit.local` is None when every neuron of the MLP is computed through the unit; a hybrid engine's split unit
(runtime/hybrid.py) sets it to the mask of the neurons the CPU computes (the others are on a device).

`ResidentUnit` (everything in memory, slot = neuron, or pair) is the fully resident case; its `tied` says whether its neurons
are tied halves (neuron I/2 + i: neuron i's gate row, minus its up row; train/tied.py). Such a unit holds *pair
records* instead of bundles, `bundles[p] = [gate_p; up_p; down_p; down_{I/2+p}]` ([I/2, 4, H], `pair_records`): each
pair's gate and up rows once, two thirds of the halves' bundles' bytes. The kernels take a list of pairs over them
(both halves from one gate and one up row: runtime/mlp.py) or of neurons, as its requests answer (each half alone,
from its pair's rows); a unit holding pair records (`pair_requests`) is asked for the pairs themselves,
`request(pairs, pairs=True)`, and answers their records' slots. In the oracle mode, which lists every pair, the gate
rows lie in a plane of their own, ahead of the other three rows of each record (`gate_plane`), so that its first pass
reads them as one stream. A tiered unit (hot
neurons pinned, cold ones behind a cache over disk) implements the same interface. A request never asks
for more than `capacity` neurons; callers with more (dense prefill under a small budget) split them into
chunks (in `unit.order(neurons)`) and release each chunk before requesting the next.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from sparseforge.runtime.pages import huge_copy, huge_empty

_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass
class Request:
    """Answer to `unit.request(neurons)`: the part resident now, and how to get the rest."""

    ready_neurons: torch.Tensor  # LongTensor [a]
    ready_slots: torch.Tensor  # LongTensor [a], slots of ready_neurons in unit.bundles
    _wait: object = None  # callable () -> (neurons, slots), or None when everything was ready
    _release: object = None  # callable () -> None
    _done: bool = field(default=False, repr=False)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(neurons, slots) of the requested neurons that were not ready; empty when all were."""
        if self._wait is None:
            return _EMPTY, _EMPTY
        return self._wait()

    def release(self) -> None:
        if not self._done and self._release is not None:
            self._release()
        self._done = True


class MLPUnit(Protocol):
    layer: int
    expert: int
    hidden: int
    intermediate: int
    capacity: int  # most neurons one request may hold at once
    bundles: torch.Tensor  # [S, 3, H], or when `tied` pair records [I/2, 4, H] or [2 I, H] (pair_records)
    scales: torch.Tensor | None  # [S, 3] ([I/2, 4] or [2 I]) float32 per-row scales when bundles are int8, else None
    channels: torch.Tensor | None  # [H] float32 per-output-channel scales of the int8 down columns, else None
    local: torch.Tensor | None  # bool [I]: the neurons computed through this unit (a hybrid split: the CPU's); None: all
    fixed_slots: torch.Tensor | None  # int64 [I]: each neuron's slot in bundles, always resident (-1: not local); None: ask request
    tied: bool  # tied halves, all resident, held as pair records
    pairs: bool  # tied halves in any two slots (a hybrid CPU part, a neuron store of bundles): slots holding j and I/2 + j are tied
    pair_requests: bool  # request(pairs, pairs=True): pair ids of tied halves -> their records' slots (a resident tied unit, a store's pair records)

    def request(self, neurons: torch.Tensor) -> Request: ...  # pair_requests units also take pairs=True

    def order(self, neurons: torch.Tensor) -> torch.Tensor:
        """The same neurons in the order to request them when they exceed `capacity` (a tiered unit: file
        order, so each chunk's misses are a few long reads)."""
        ...


def row_bytes(unit: MLPUnit) -> int:
    """Bytes a kernel reads for one row of a bundle (gate row, up row or down column), its int8 scale included."""
    return unit.hidden * unit.bundles.element_size() + (4 if unit.scales is not None else 0)


def make_bundles(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """gate, up: [I, H]; down: [H, I] -> bundles [I, 3, H] (contiguous)."""
    return torch.stack([gate, up, down.t()], dim=1).contiguous()


def quantize_bundles(bundles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A unit's bundles [I, 3, H] float -> (int8 [I, 3, H], row scales float32 [I, 3], channels float32 [H]).

    Gate and up rows: symmetric per row (quantize_rows). Down columns are first divided by one scale per output
    channel, `channels` = max over the unit's neurons of |down[h, :]| / 127, then quantized per row: a dequantized
    down column is int8 row * row scale * channels. With one scale per down column alone, the residual stream's
    few large channels would set every column's scale and crush the others (docs/runtime.md
    "Kernels: int8 down columns"); a zero channel gets scale 1."""
    b = bundles.float()
    top = b[:, 2].abs().amax(dim=0)
    channels = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    q, scales = quantize_rows(torch.cat([b[:, :2], (b[:, 2] / channels)[:, None]], dim=1))
    return q, scales, channels.contiguous()


def convert_bundles(bundles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A unit's bundles [I, 3, H] in `dtype`: (bundles, row scales [I, 3], channel scales [H]); the scales are None
    unless dtype is int8 (quantize_bundles), the bundles on huge pages (runtime/pages.py). What resident units hold and
    what bundle files store."""
    if dtype == torch.int8:
        q, scales, channels = quantize_bundles(bundles)
        return huge_copy(q), scales, channels
    return huge_copy(bundles, dtype), None, None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 over the last dimension: w [..., K] float -> (int8 [..., K], scales float32 [...]).
    Dequantised row = int8 row * scale; a zero row gets scale 1."""
    b = w.float()
    amax = b.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(b / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def tied_bundles(bundles: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether bundles [I, 3, H] (with int8 row scales [I, 3]) are tied halves: neuron I/2 + i has neuron i's gate row
    and minus its up row, exactly as stored."""
    from sparseforge.sparsify.convert import tied_pairs

    half = bundles.shape[0] // 2
    return tied_pairs(bundles[:, 0], bundles[:, 1]) and (scales is None or torch.equal(scales[:half, :2], scales[half:, :2]))


def pair_records(bundles: torch.Tensor, scales: torch.Tensor | None, gate_plane: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bundles [I, 3, H] of tied halves (tied_bundles), with int8 row scales [I, 3] -> one record per pair, [I/2, 4, H]:
    its gate row, its up row, then the first and the second half's down columns (scales [I/2, 4]). gate_plane: the
    pairs' gate rows first, then each pair's other three rows, as one tensor [2 I, H] (scales [2 I])."""
    half, _, hidden = bundles.shape
    half //= 2
    s = None if scales is None else torch.cat([scales[:half], scales[half:, 2:]], dim=1)  # [I/2, 4]
    if not gate_plane:
        records = huge_empty((half, 4, hidden), bundles.dtype)
        records[:, :3], records[:, 3] = bundles[:half], bundles[half:, 2]
        return records, s
    records = huge_empty((4 * half, hidden), bundles.dtype)
    rest = records[half:].view(half, 3, hidden)
    records[:half], rest[:, :2], rest[:, 2] = bundles[:half, 0], bundles[:half, 1:], bundles[half:, 2]
    return records, None if s is None else torch.cat([s[:, 0], s[:, 1:].reshape(-1)])


def record_rows(records: torch.Tensor, scales: torch.Tensor | None, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The records of `pairs` (pair_records, either layout) as [k, 4, H] rows, with their int8 scales [k, 4] (else None)."""
    if records.dim() == 3:
        return records.index_select(0, pairs), None if scales is None else scales.index_select(0, pairs)
    half = records.shape[0] // 4
    rows = torch.cat([records.index_select(0, pairs)[:, None], records[half:].view(half, 3, -1).index_select(0, pairs)], dim=1)
    if scales is None:
        return rows, None
    return rows, torch.cat([scales.index_select(0, pairs)[:, None], scales[half:].view(half, 3).index_select(0, pairs)], dim=1)


class ResidentUnit:
    """All of a unit's neurons in memory: slot j holds neuron j, or for tied halves pair j's record (pair_records)."""

    local = None
    fixed_slots = None
    pairs = False  # tied halves are held as pair records: `tied`

    def __init__(self, layer: int, expert: int, bundles: torch.Tensor, scales: torch.Tensor | None = None, channels: torch.Tensor | None = None,
                 gate_plane: bool = False):
        """bundles [I, 3, H] (with int8 row scales [I, 3] and channel scales [H]); tied halves are kept as pair records
        (gate_plane: their gate rows in a plane of their own)."""
        self.layer, self.expert = layer, expert
        self.intermediate, _, self.hidden = bundles.shape
        self.capacity = self.intermediate
        self.tied = tied_bundles(bundles, scales)
        if self.tied:
            bundles, scales = pair_records(bundles, scales, gate_plane)
        self.bundles, self.scales, self.channels = bundles, scales, channels

    @property
    def pair_requests(self) -> bool:
        """Tied halves: request(pairs, pairs=True) answers pair records' slots, slot = pair."""
        return self.tied

    def request(self, neurons: torch.Tensor, pairs: bool = False) -> Request:
        return Request(ready_neurons=neurons, ready_slots=neurons)

    def order(self, neurons: torch.Tensor) -> torch.Tensor:
        return neurons
