"""An exact screen of a ReLU-family MLP: which neurons cannot fire, found without their full-precision rows.

A dReLU neuron, relu(gate . x) * relu(up . x), is zero whenever its gate or its up pre-activation is <= 0 (ReLU,
shifted ReLU, FATReLU: whenever the gate is at or below its threshold). The engine's "screen" mode (runtime/model.py)
keeps per MLP unit an int8 copy Q of the gate rows (and, for dReLU, of the up rows) with a per-row scale s, and two
per-row numbers rounded up at load,

    r = |w - s Q|_2 + gamma (|w|_2 + s |Q|_2)      n = s |Q|_2      (gamma = (H + 2) u / (1 - (H + 2) u), u = 2^-24)

with w the row as the sparse kernel reads it (the engine's weight dtype). For any float32 evaluation g of w . x,
in any summation order,

    g <= s d (Q . q) + r |x|_2 + n |x - d q|_2        (native: x rounded to int16 q with one scale d, Q . q exact)
    g <= s fl(Q . x) + r |x|_2 + 2u |s fl(Q . x)|     (PyTorch: float32 x)

(Cauchy-Schwarz on the rounding of w, the float error bound of a dot product, and on the rounding of x). A neuron
whose gate bound G makes the activation zero, or, for dReLU, whose up bound U is <= 0, or, for a thresholded dReLU
(h = relu(g) relu(u), zeroed where h <= t), whose product G U is <= t (float rounding is monotone, so fl(g u) <= t
too), is zero in the exact-mask (oracle) forward too; the others go to the sparse kernel, which computes them in full precision. So a screen step
equals the oracle step up to the float order of the kept neurons' sums, with no predictor and no training.

Per token and unit a native step reads the gate screen of every neuron (H + 12 bytes each), the up screen of the
neurons the gate screen keeps, and the sparse kernel's rows of the neurons both keep. The screen needs float weights:
int8 weights are already what it would read (the oracle mode reads every int8 gate row once).

Tied halves (train/tied.py: neuron I/2 + i has neuron i's gate row and minus its up row, exactly, in the engine's
weight dtype; found at load) are screened a pair at a time by their one gate row: the screen lists the pairs whose
gate bound it cannot prove zero, and the sparse kernel computes each listed pair from its one gate and one up row,
which tells which half, if either, fires. A tied screen holds no up rows: the up row that picks the half is read
once, in the engine's precision, by the kernel that needs it anyway (docs/runtime.md, "Modes").
"""

from dataclasses import dataclass, field

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.predictors.model import both_halves
from sparseforge.runtime import kernels
from sparseforge.sparsify.convert import tied_pairs
from sparseforge.sparsify.hf_code.modeling_sparseforge import GatedActivation

SCREENED = ("relu", "drelu", "shifted_relu", "fatrelu")  # activations a gate bound can prove zero
ROW_EXTRA_BYTES = 12  # per screened row besides its int8 values: scale, radius, norm (float32 each)
SCREEN_ROWS = 4  # rows up to which a PyTorch step screens (more: every neuron, as oracle; the rows' union keeps most)
_U = 2.0**-24
_CHUNK = 4096  # rows at a time in float64


@dataclass
class ScreenRows:
    """int8 copy of a [I, H] float matrix with what bounds its rows' dot products (module docstring)."""

    q: torch.Tensor  # int8 [I, H]
    scales: torch.Tensor  # float32 [I]
    radius: torch.Tensor  # float32 [I], r
    norm: torch.Tensor  # float32 [I], n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.radius, self.norm))


@dataclass
class UnitScreen:
    """One MLP unit's screen: gate rows, up rows (dReLU only), its activation, and the native call's buffers."""

    gate: ScreenRows
    up: ScreenRows | None
    activation: GatedActivation
    tied: bool = False  # tied halves: the gate rows are the first half's, each bounding pair i (neurons i and rows + i); no up rows
    ids: torch.Tensor = field(init=False)  # int64 [I]: the native screen's kept ids (pairs, for tied halves)
    up_rows: torch.Tensor = field(init=False)  # int64 [1]: up rows the native screen read (added to)
    scratch: torch.Tensor = field(init=False)  # float64: the native screen's gate bounds [rows], then its flags (rows bytes)

    def __post_init__(self):
        if self.tied and (self.up is not None or self.activation.kind != "drelu"):
            raise SparseforgeError("a tied screen bounds the pairs of dReLU halves by their gate rows alone; screen this unit untied")
        self.ids = torch.empty(self.intermediate, dtype=torch.long)
        self.up_rows = torch.zeros(1, dtype=torch.long)
        self.scratch = torch.empty(self.rows + -(-self.rows // 8), dtype=torch.float64)

    @property
    def rows(self) -> int:
        """Screened rows per matrix: every neuron's, or each tied pair's one."""
        return self.gate.q.shape[0]

    @property
    def intermediate(self) -> int:
        return self.rows * (2 if self.tied else 1)

    @property
    def row_bytes(self) -> int:
        """Bytes one screened row reads: int8 values and the three per-row numbers."""
        return self.gate.q.shape[1] + ROW_EXTRA_BYTES

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + (self.up.nbytes if self.up is not None else 0)

    def tables(self) -> tuple:
        """The eight pointers sf_mlp_screen and sf_decode_layers take (up's are None without up rows)."""
        p = kernels.ptr
        up = (self.up.q, self.up.scales, self.up.radius, self.up.norm) if self.up is not None else (None,) * 4
        return (p(self.gate.q), p(self.gate.scales), p(self.gate.radius), p(self.gate.norm), *(p(t) for t in up))


def _round_up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 values at or above it."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.tensor(float("inf"))), f)


def screen_rows(w: torch.Tensor) -> ScreenRows:
    """w: [I, H] float32/bfloat16/float16 (as the kernel reads it) -> its int8 screen with r and n rounded up."""
    rows, cols = w.shape
    n_ = cols + 2
    gamma = n_ * _U / (1 - n_ * _U)
    out = ScreenRows(torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows), torch.empty(rows), torch.empty(rows))
    for a in range(0, rows, _CHUNK):
        wd = w[a : a + _CHUNK].double()
        s = (wd.abs().amax(1) / 127).float()  # the scale as stored; Q is rounded against it
        sd = s.double()
        q = torch.round(wd / sd.clamp_min(1e-300)[:, None]).clamp(-127, 127)
        q = torch.where(sd[:, None] > 0, q, torch.zeros_like(q))  # a zero row: Q = 0, s = 0
        qn = sd * q.norm(dim=1)
        r = (wd - sd[:, None] * q).norm(dim=1) + gamma * (wd.norm(dim=1) + qn)
        out.q[a : a + _CHUNK] = q.to(torch.int8)
        out.scales[a : a + _CHUNK] = s
        out.radius[a : a + _CHUNK] = _round_up(r * (1 + 1e-6))
        out.norm[a : a + _CHUNK] = _round_up(qn * (1 + 1e-6))
    return out


def unit_screen(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation, tied: bool = False) -> UnitScreen:
    """gate, up: [I, H] in the engine's float weight dtype -> the unit's screen (up rows for dReLU only: the others'
    up can be negative on a firing neuron). tied: the rows are tied halves (sparsify.convert.tied_pairs; checked),
    screened by pair through the first half's gate rows alone."""
    if activation.kind not in SCREENED:
        raise SparseforgeError(f"the screen proves neurons zero from their gate's sign; a {activation.kind} MLP has none to "
                               f"prove ({', '.join(SCREENED)} do): use mode='oracle' or 'sparse'")
    if tied:
        if not tied_pairs(gate, up):
            raise SparseforgeError("tied screen: the gate and up rows are not tied halves; screen this unit untied")
        return UnitScreen(screen_rows(gate[: gate.shape[0] // 2]), None, activation, tied=True)
    return UnitScreen(screen_rows(gate), screen_rows(up) if activation.kind == "drelu" else None, activation)


def load_screens(reader, model) -> dict[tuple[int, int], UnitScreen]:
    """Every MLP unit's screen, per (layer, expert), from the checkpoint's gate and up rows in the model's weight
    dtype; a dReLU unit of neuron halves whose pairs are tied there is screened by pair."""
    from sparseforge.runtime.weights import WEIGHT_DTYPES

    dtype = WEIGHT_DTYPES[model.weight_dtype]
    if dtype == torch.int8:
        raise SparseforgeError("mode='screen' needs float weights: int8 gate rows are already what a screen reads "
                               "(mode='oracle' reads each once); use weight_dtype float32, bfloat16 or float16")  # fmt: skip
    out, halves = {}, bool((model.config.sparsity or {}).get("halves"))
    for i, lw in enumerate(model.weights.layers):
        for e in range(len(lw.units)):
            gate, up, _ = reader.mlp(i, e)
            gate, up, act = gate.to(dtype), up.to(dtype), model.activations[i]
            tied = halves and act.kind == "drelu" and tied_pairs(gate, up)
            out[(i, e)] = unit_screen(gate, up, act, tied)
    return out


def screens_nbytes(screens: dict | None) -> int:
    return sum(s.nbytes for s in (screens or {}).values())


def screen_applies(activation: str | None, weight_dtype: str) -> bool:
    """Whether the screen mode can run: an activation a gate bound proves zero and float weights."""
    return activation in SCREENED and weight_dtype != "int8"


def planned_screens_bytes(units: int, intermediate: int, hidden: int, activation: str | None, tied_halves: bool) -> int:
    """The bytes load_screens will hold for `units` MLPs, from the config alone (a placement plan's reserve): per unit
    the pairs' gate rows of tied dReLU halves, the gate and up rows of other dReLU units, the gate rows of the other
    screened activations, each row hidden int8 values and ROW_EXTRA_BYTES."""
    rows = intermediate // 2 if tied_halves and activation == "drelu" else 2 * intermediate if activation == "drelu" else intermediate
    return units * rows * (hidden + ROW_EXTRA_BYTES)


def screen_native(screen: UnitScreen, x: torch.Tensor, threads: int) -> tuple[torch.Tensor, int]:
    """x: [H] float32, contiguous -> (ascending ids of the neurons the screen keeps, or for tied halves of the pairs
    (a view of screen.ids), bytes the screen read)."""
    act = screen.activation
    before = int(screen.up_rows[0])
    n = kernels.native().sf_mlp_screen(*screen.tables(), screen.intermediate, x.shape[0], x.data_ptr(),
                                       kernels.ACT_CODES[act.kind], act.threshold, screen.ids.data_ptr(),
                                       screen.up_rows.data_ptr(), screen.scratch.data_ptr(), int(screen.tied), threads)  # fmt: skip
    return screen.ids[:n], (screen.rows + int(screen.up_rows[0]) - before) * screen.row_bytes


def _bounds(rows: ScreenRows, x: torch.Tensor, xl2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(approx, slack) [N, I] (float64): every float evaluation of the rows' dot products with x [N, H] float32 is at
    most approx + slack, and of the negated rows' at most -approx + slack."""
    approx = (x @ rows.q.float().T).double() * rows.scales.double()  # s fl(Q . x), the product in float64
    return approx, xl2[:, None] * rows.radius.double() + 2 * _U * approx.abs()


def screen_torch(screen: UnitScreen, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """PyTorch reference: x [N, H] float32 -> (keep [N, I] bool: the neurons the screen cannot prove zero, bytes read
    as the native screen reads them for each row)."""
    x = x.float()
    xl2 = x.double().norm(dim=1) * (1 + 1e-9)
    act = screen.activation
    g = sum(_bounds(screen.gate, x, xl2))
    keep = ~(g <= (act.threshold if act.kind in ("shifted_relu", "fatrelu") else 0.0))  # NaN keeps the neuron
    up_rows = int(keep.sum()) if screen.up is not None else 0
    if screen.tied:
        keep = both_halves(keep)
    elif screen.up is not None:
        keep = _up_keeps(keep, g, sum(_bounds(screen.up, x, xl2)), act)
    return keep, (x.shape[0] * screen.rows + up_rows) * screen.row_bytes


def _up_keeps(keep: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """The gate's keep [N, rows] narrowed by the up bounds u [N, rows]: up <= 0, or a product bound at most the
    threshold, proves the neuron zero."""
    keep = keep & ~(u <= 0)
    if act.kind == "drelu" and act.threshold > 0:  # where keep holds, g > 0 and u > 0: bound the product
        keep &= ~(g * u * (1 + 1e-9) <= act.threshold)
    return keep
