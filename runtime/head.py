"""The greedy decode token without reading the whole lm_head (a head screen).

A greedy step needs argmax_v (W x)_v, not the logits. SmolLM2-135M's lm_head is [49152, 576]: 113 MB of the
~300 MB a float32 sparse decode token reads, 57 MB in float16. The screen keeps an int8 copy Q of W (per-row
scales s) and per row a radius r_v and a = s_v sum_j |Q_vj|. A step rounds x to int16 with one scale d (x = d q + e,
|e_j| <= e), sums Q_v . q exactly in integers, and then

    |y_v - s_v d (Q_v . q)| <= r_v |x|_1 + a_v e

where y_v is the logit sf_matvec computes: r_v is the rounding error max_j |W_vj - s_v Q_vj| plus a bound on the
float error of the sums and of the interval arithmetic (3 gamma_n max_j |W_vj|, gamma_n = n u / (1 - n u),
u = 2^-24, n = columns + 2), and a_v e bounds what rounding x moved (e is ~max|x| / 65534, so this term is small).
Both are rounded up. Each step streams Q (a quarter of the float32 head's bytes) and reads W's rows only for the
candidates: the rows whose upper bound reaches the largest lower bound. The
argmax is among them (its upper bound is at least its logit, which is at least every lower bound), and the
candidates' logits are computed with sf_matvec's operations in its order (csrc `head_row`), so the token is the
argmax of the full sf_matvec logits bit for bit, ties to the lowest id as torch.argmax. On the stage-3 SmolLM2
decodes 3.6 rows per token were candidates on average, 38 at most (docs/runtime.md "Head screen").

Only greedy steps use it; sampling with a temperature needs every logit and reads the whole head. float32,
bfloat16 and float16 heads without a bias get one; an int8 head is already as small as its screen would be.
"""

import torch

from sparseforge.runtime import kernels

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 4096  # rows quantized at a time (float64 work space: chunk x columns x 8 bytes)


def screen_bytes(rows: int, cols: int) -> int:
    """Memory a screen of a [rows, cols] head takes: Q (int8), scales, radii, a_v and the two per-row work arrays
    (float32 screened values, int64 candidate ids)."""
    return rows * cols + rows * (4 + 4 + 4 + 4 + 8)


def screen_rows_bytes(rows: int, cols: int) -> int:
    """What one greedy step streams before the candidates' rows: Q, scales, radii, a_v and the screened values."""
    return rows * cols + rows * (4 + 4 + 4 + 4)


def _round_up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 values at or above it."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.tensor(float("inf"))), f)


class HeadScreen:
    """An int8 screen of a float head weight [V, H]; `argmax(x)` is the greedy token of x [H]."""

    def __init__(self, weight: torch.Tensor, threads: int):
        if weight.dtype not in FLOAT_DTYPES:
            raise ValueError(f"a head screen needs a float32, bfloat16 or float16 head, not {weight.dtype}")
        self.weight, self.threads = weight, threads
        rows, cols = weight.shape
        self.q = torch.empty(rows, cols, dtype=torch.int8)
        self.scales = torch.empty(rows)
        self.radius = torch.empty(rows)
        self.qabs = torch.empty(rows)
        self.approx = torch.empty(rows)
        self.cand = torch.empty(rows, dtype=torch.long)
        self.ncand = torch.zeros(1, dtype=torch.long)
        u = 2.0**-24
        gamma = (cols + 2) * u / (1 - (cols + 2) * u)
        for a in range(0, rows, _CHUNK):
            w = weight[a : a + _CHUNK].double()
            top = w.abs().amax(1)
            s = (top / 127).float()  # the scale as stored; Q is rounded against it
            sd = s.double()
            q = torch.where(sd[:, None] > 0, torch.round(w / sd.clamp_min(1e-300)[:, None]), torch.zeros_like(w)).clamp(-127, 127)
            err = (w - sd[:, None] * q).abs().amax(1)
            big = torch.maximum(top, 127 * sd)  # bounds |W_vj| and |s_v Q_vj|
            r = (err + 3 * gamma * big) * (1 + 1e-6)
            self.radius[a : a + _CHUNK] = _round_up(r)
            self.qabs[a : a + _CHUNK] = _round_up(sd * q.abs().sum(1) * (1 + 1e-6))
            self.scales[a : a + _CHUNK] = s
            self.q[a : a + _CHUNK] = q.to(torch.int8)
        p = kernels.ptr
        self._call = kernels.native().sf_head_argmax  # its arguments, but the input, prepared once (decode's hot path)
        self._head = (p(weight), kernels.DTYPE_CODES[weight.dtype], rows, cols, p(self.q), p(self.scales), p(self.radius), p(self.qabs))
        self._out = (p(self.approx), p(self.cand), p(self.ncand), threads)
        self.step_bytes = screen_rows_bytes(rows, cols)  # what a call streams besides its candidates' rows
        self.row_bytes = cols * weight.element_size()  # one candidate's row

    @property
    def nbytes(self) -> int:
        return screen_bytes(*self.weight.shape)

    def argmax(self, x: torch.Tensor) -> tuple[int, int]:
        """x: float32 [H], contiguous -> (the greedy token, rows of the head computed exactly)."""
        token = self._call(*self._head, x.data_ptr(), *self._out)
        return int(token), int(self.ncand[0])

    def candidates(self) -> torch.Tensor:
        """The last argmax call's candidate rows (ascending); `approx` holds their exact logits and every other
        row's screened value."""
        return self.cand[: int(self.ncand[0])].clone()
