"""The one meter: every path of a forward reports its tokens, seconds, neurons and weight bytes here, and
`Engine.stats` reads them from here.

What a decode step touches is counted from what the kernels read:
- the always-touched weights (attention, norms, routers, one embedding row, the predictors run), once per step;
- the KV cache of every row up to its new position;
- the MLPs: a PyTorch or dense MLP reports its bytes, a screen (runtime/screen.py) the int8 rows it read; the native sparse kernel counts the gate
  rows, up rows and down columns it reads into `rows_read` (a tensor it writes through a pointer; a computed neuron reads
  its gate row, or with tied halves a pair reads one);
- the head: all of it, or the screen and its candidates' rows (runtime/head.py).
Prefill steps count tokens and seconds only. Neurons are counted over every row, and over decode steps alone
(`decode_neurons_*`: a screen computes a prefill's neurons in full, so the two differ).
"""

import time

import torch


def always_touched_bytes(weights, predictors: dict | None, top_k: int) -> int:
    """Weight bytes every decode step reads outside the MLP units and the head: attention, norms, routers, one
    embedding row, and the predictors it runs (all of them; MoE: the routed experts' share)."""
    total = weights.final_norm.numel() * 4 + weights.embed.shape[1] * weights.embed.element_size()
    for lw in weights.layers:
        total += lw.qkv.nbytes + lw.o.nbytes + 4 * (lw.input_norm.numel() + lw.post_norm.numel())
        total += sum(4 * t.numel() for t in (lw.q_norm, lw.k_norm, lw.router) if t is not None)
    if predictors:
        experts = max(1, len(predictors) // len(weights.layers))
        total += sum(p.nbytes for p in predictors.values() if p is not None) * top_k // experts
    return total


class Meter:
    """Counters since construction or `reset()`. `reset` zeroes them in place: `rows_read` keeps its storage, so the
    native decode step may hold its pointer."""

    def __init__(self, static_bytes: int, kv_bytes_per_position: int):
        self.static_bytes = static_bytes  # always_touched_bytes
        self.kv_bytes_per_position = kv_bytes_per_position  # one row's keys + values of one position, every layer
        self.rows_read = torch.zeros(3, dtype=torch.long)  # gate rows, up rows, down columns (fired neurons) read by sf_sparse_mlp
        self.device_fired = None  # a hybrid engine's device-side count of its hot neurons that fired (runtime/hybrid.py)
        self.reset()

    def reset(self) -> None:
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_seconds = self.decode_seconds = self.predictor_seconds = 0.0
        self.neurons_computed = self.neuron_slots = self.neurons_fired = 0  # PyTorch and dense MLPs, over all rows
        self.row_neurons = 0  # neurons the native sparse kernel computed
        self.row_bytes = 0  # bytes of one bundle row (+ its int8 scale) of the native kernel's units
        self.rows_read.zero_()
        if self.device_fired is not None:
            self.device_fired.zero_()
        self.decode_bytes = 0
        self.step_bytes = 0  # MLP and head bytes of the forward in progress
        self.screened_tokens = self.screen_candidates = 0
        self.decode_computed = self.decode_slots = self.decode_fired = 0  # the neuron counts of decode steps alone
        self._mark = (0, 0, 0)  # the neuron totals when the last step closed
        self.cpu_part_seconds = self.device_wait_seconds = 0.0  # a hybrid engine's one-token steps: its CPU parts, its waits for the device

    def scalars(self) -> dict:
        """The counters held as Python numbers (what a replayed CUDA graph cannot add itself: runtime/graphs.py)."""
        return {k: v for k, v in vars(self).items() if type(v) in (int, float)}

    def add(self, counts: dict) -> None:
        for k, v in counts.items():
            setattr(self, k, getattr(self, k) + v)

    def restore(self, counts: dict) -> None:
        for k, v in counts.items():
            setattr(self, k, v)

    def mlp(self, computed: int, slots: int, fired: int, weight_bytes: int) -> None:
        """A PyTorch or dense MLP over some rows: neurons computed, neurons it could have computed, neurons that fired."""
        self.neurons_computed += computed
        self.neuron_slots += slots
        self.neurons_fired += fired
        self.step_bytes += weight_bytes

    def native_mlp(self, neurons: int, slots: int, row_bytes: int) -> None:
        """The native sparse kernel over one row: `neurons` computed of `slots`; it counted its reads in `rows_read`."""
        self.row_neurons += neurons
        self.neuron_slots += slots
        self.row_bytes = row_bytes

    def screen(self, nbytes: int) -> None:
        """An exact MLP screen's reads (runtime/screen.py): its int8 rows and their per-row numbers."""
        self.step_bytes += nbytes

    def hybrid_split(self, start: float, mid: float) -> None:
        """A hybrid engine's one-token step through a layer with cold neurons: `start` to `mid` (perf_counter) went to
        waiting for the device, `mid` to now to the CPU's part."""
        self.device_wait_seconds += mid - start
        self.cpu_part_seconds += time.perf_counter() - mid

    def predictor(self, seconds: float) -> None:
        self.predictor_seconds += seconds

    def head(self, nbytes: int, candidates: int | None = None) -> None:
        """Head bytes read; `candidates`: the rows a screened step computed exactly."""
        self.step_bytes += nbytes
        if candidates is not None:
            self.screened_tokens += 1
            self.screen_candidates += candidates

    def _neuron_totals(self) -> tuple[int, int, int]:
        device = 0 if self.device_fired is None else int(self.device_fired)
        return self.neurons_computed + self.row_neurons, self.neuron_slots, self.neurons_fired + int(self.rows_read[2]) + device

    def step(self, rows: int, tokens: int, seconds: float, length: int) -> None:
        """Close a forward of `tokens` positions in each of `rows` rows, written after `length` cached ones. One position:
        a decode step, with its bytes and neurons; more: prefill."""
        totals = self._neuron_totals()
        if tokens == 1:
            self.decode_computed += totals[0] - self._mark[0]
            self.decode_slots += totals[1] - self._mark[1]
            self.decode_fired += totals[2] - self._mark[2]
            self.decode_tokens += rows
            self.decode_seconds += seconds
            self.decode_bytes += self.step_bytes + self.static_bytes + rows * (length + 1) * self.kv_bytes_per_position
        else:
            self.prefill_tokens += rows * tokens
            self.prefill_seconds += seconds
        self.step_bytes = 0
        self._mark = totals

    def counters(self) -> dict:
        """The figures `Engine.stats` reports from the counters."""
        gate, up, down = (int(v) for v in self.rows_read)
        decode_bytes = self.decode_bytes + (gate + up + down) * self.row_bytes
        slots = self.neuron_slots
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens / self.decode_seconds if self.decode_seconds else None,
            "neurons_computed_fraction": (self.neurons_computed + self.row_neurons) / slots if slots else None,
            "neurons_fired_fraction": (self.neurons_fired + down + (0 if self.device_fired is None else int(self.device_fired))) / slots if slots else None,
            "decode_neurons_computed_fraction": self.decode_computed / self.decode_slots if self.decode_slots else None,
            "decode_neurons_fired_fraction": self.decode_fired / self.decode_slots if self.decode_slots else None,
            "predictor_seconds": self.predictor_seconds,
            "bytes_touched_per_decode_token": decode_bytes / self.decode_tokens if self.decode_tokens else None,
            "head_rows_per_screened_token": self.screen_candidates / self.screened_tokens if self.screened_tokens else None,
        }
