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
argmax of the full sf_matvec logits bit for bit, ties to the lowest id as torch.argmax. `generate --stats` reports
the candidate rows per screened token (docs/runtime.md "Head screen").

Sampled steps use it too (runtime/sampling.py draws a token as the argmax of the filtered logits / T plus Gumbel
noise, one value per row): without top-k/top-p the candidates are the rows whose bounds of y_v / T + g_v reach the
largest lower bound, with top-k (up to MAX_TOP_K) the rows whose upper bound reaches the k-th largest lower bound (the
k largest logits are among them, so top-p inside them is exact too). Top-p without top-k needs every logit and reads
the whole head. float32, bfloat16 and float16 heads without a bias get a screen; an int8 head is already as small as
its screen would be.
"""

import torch

from sparseforge.runtime import kernels
from sparseforge.runtime.pages import huge_empty

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TOP_K = 1024  # top-k screens up to this k (csrc SF_HEAD_TOPK); a larger k reads the whole head
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
        self.q = huge_empty((rows, cols), torch.int8)
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
        self._call = kernels.native().sf_head_screen  # its arguments, but the input and the rule, prepared once (decode's hot path)
        self._head = (p(weight), kernels.DTYPE_CODES[weight.dtype], rows, cols, p(self.q), p(self.scales), p(self.radius), p(self.qabs))
        self._out = (p(self.approx), p(self.cand), p(self.ncand), threads)
        self.step_bytes = screen_rows_bytes(rows, cols)  # what a call streams besides its candidates' rows
        self.row_bytes = cols * weight.element_size()  # one candidate's row

    @property
    def nbytes(self) -> int:
        return screen_bytes(*self.weight.shape)

    def argmax(self, x: torch.Tensor) -> tuple[int, int]:
        """x: float32 [H], contiguous -> (the greedy token, rows of the head computed exactly)."""
        token = self._call(*self._head, x.data_ptr(), None, 1.0, 0, *self._out)
        return int(token), int(self.ncand[0])

    def noisy_argmax(self, x: torch.Tensor, noise: torch.Tensor, temperature: float) -> int:
        """The token argmax_v (y_v / temperature + noise_v) with y = W x as sf_matvec computes it, the division and
        the sum in float32 as torch does them (sampling.pick). noise: float32 [V], contiguous; temperature > 0."""
        if self._call(*self._head, x.data_ptr(), noise.data_ptr(), float(temperature), 0, *self._out) == -2:
            raise ValueError(f"temperature {temperature} is not positive: a sampled step needs temperature > 0")
        cand = self.candidates()
        return int(cand[torch.argmax(self.approx[cand] / temperature + noise[cand])])

    def top_k_logits(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """float32 [V]: y = W x's k largest values (and every value tied with the k-th) as sf_matvec computes them,
        and the other rows whose bounds reach the k-th largest lower bound (~11 k on stage 3 at k = 50); -inf everywhere
        else. 1 <= k <= MAX_TOP_K."""
        if not 1 <= k <= MAX_TOP_K or self._call(*self._head, x.data_ptr(), None, 1.0, k, *self._out) == -2:
            raise ValueError(f"top_k={k} is outside 1..{MAX_TOP_K}, what a head screen selects")
        cand = self.candidates()
        return torch.full_like(self.approx, float("-inf")).index_copy_(0, cand, self.approx[cand])

    def candidates(self) -> torch.Tensor:
        """The last call's candidate rows (ascending); `approx` holds their exact logits and every other
        row's screened value."""
        return self.cand[: int(self.ncand[0])].clone()


class Head:
    """The lm_head as a forward step reads it, reporting its bytes to the meter: the logits of rows (the whole head),
    or, through the screen, the token of one row reading only the rows that can be it (runtime/sampling.py
    `next_token` chooses which)."""

    def __init__(self, linear, screen: HeadScreen | None, meter):
        self.linear, self.screen, self.meter = linear, screen, meter
        self.vocab, self.nbytes = linear.weight.shape[0], linear.nbytes

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] final-normed rows -> float32 logits [N, V]."""
        self.meter.head(self.nbytes)
        return self.linear(x)

    def argmax(self, x: torch.Tensor) -> int:
        """Screened: the greedy token of x [H] (the argmax of sf_matvec's logits)."""
        token, candidates = self.screen.argmax(x)
        self._screened(candidates)
        return token

    def noisy_argmax(self, x: torch.Tensor, noise: torch.Tensor, temperature: float) -> int:
        """Screened: argmax_v (logit_v / temperature + noise_v) of x [H] (HeadScreen.noisy_argmax)."""
        token = self.screen.noisy_argmax(x, noise, temperature)
        self._screened(int(self.screen.ncand[0]))
        return token

    def top_k_logits(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Screened: float32 [V], the k largest logits of x [H] exact, -inf where no bound reaches them (HeadScreen.top_k_logits)."""
        logits = self.screen.top_k_logits(x, k)
        self._screened(int(self.screen.ncand[0]))
        return logits

    def _screened(self, candidates: int) -> None:
        self.meter.head(self.screen.step_bytes + candidates * self.screen.row_bytes, candidates)
