"""Stage 1, layer-wise MLP distillation: each sparse MLP learns to reproduce its dense SwiGLU original.

One pass goes through the decoder layer by layer over all windows, keeping the residual stream of every
token (the cost of one forward pass, whatever the number of layers). At layer l:

1. the layer runs with its MLP swapped for a capture, giving the MLP inputs x and the residual r after
   attention; `inputs="teacher"` takes x from the dense model's own stream, `inputs="student"` from the
   student's (layers < l already distilled, so layer l learns to work on the inputs it will really see);
2. the target: `target="mlp"` is the dense MLP's output on the same x, y = down(silu(gate(x)) * up(x));
   `target="stream"` (student inputs only) is what brings the student's stream back onto the dense model's,
   y = h_teacher(l+1) - r, so each MLP also corrects the error of the layers before it;
3. `init="lsq"` (or "split") first rebuilds the sparse MLP from the dense one (below); with `target_zeros` the layer's dReLU
   threshold is set for that fraction of exact zeros on x between the rebuild and the refit, so the refit,
   Adam and every later layer work with it in place (and set again after Adam, which moves the products); then
   Adam minimizes sum_t w_t ||mlp(x_t) - y_t||^2 / sum_t w_t ||y_t||^2 for `epochs` passes;
4. the student stream moves on: h = r + mlp(x).

The init. dReLU keeps a neuron's output only where gate and up are both positive, so a SwiGLU neuron whose
useful output comes with up < 0 is lost as converted. Since relu(g) * relu(-u) * (-d) is the same neuron read
the other way, each neuron takes the sign of (up, down) that keeps more of its SwiGLU output on x; then down
is refit by ridge least squares on all tokens, shrunk towards the dense down:
    D = (Y^T H + lam D0) (H^T H + lam I)^-1,   H = act(gate(x), up(x)): [T, I],  Y: [T, hidden],
lam = `ridge` times the mean diagonal of H^T H.
Both steps are closed form; they alone take most layers' relative error from 0.3-0.8 to 0.05-0.6.
`init="split"` chooses among all 2I (neuron, sign) candidates instead of one sign per neuron: the I whose output
relu(g) * relu(+-u) * ||d|| carries the most energy on x, so a neuron whose output comes with both signs of up keeps
both halves and the weakest neurons make room; the refit is the same. A student with neuron halves
(sparsify.convert.split_halves: 2I neurons) keeps all 2I candidates. `init="split4"` chooses among all 4I (neuron,
gate sign, up sign) quarters relu(+-g) * relu(+-u), by the SwiGLU output energy silu(g)^2 u^2 ||d||^2 in each
quarter's region: a layer whose SwiGLU output comes largely from silu's negative lobe (g < 0) keeps some of it. The
target, the choice, the refit and (without Adam) the student's output read one computation of the tokens' gate and
up pre-activations (kept up to LSQ_CACHE_BYTES). `epochs=0` is the closed form alone.

The token weights. Every sum over tokens above (the init's choice and refit, Adam's loss, the reported errors)
weighs token t by w_t: 1 (`weights="uniform"`), or 1 / mean(h_t^2), h_t the stream after the layer on target,
scaled to mean 1 (`"stream"`: an output error counts as much as it moves the RMS-normed stream the next layer
reads). Unweighted, the first token of a window (an attention sink, its stream far larger than the others') carries
most of some layers' squared output, and their reported error is mostly that token's.

Precision: float32 tensors throughout; with `bf16_products` (train/precision.py: where bf16 is native to the CPU and
the recipe's mixed precision is bf16) each layer's MLP work multiplies in bf16 with float32 accumulation, while the
attention that makes the MLP inputs stays float32.

Only MLP weights change. Dense-MLP families only (MoE experts are left to end-to-end training).
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from sparseforge.errors import SparseforgeError
from sparseforge.sparsify.threshold import LargestPositive
from sparseforge.train.precision import bf16_products, float32_products
from sparseforge.train.thresholds import THRESHOLD_TOKENS

_CHUNK = 4096  # tokens per matmul when streaming over all tokens of a layer
DIAG_TOKENS = 4096  # the per-layer relative errors are measured on this many of a layer's tokens, evenly strided
LSQ_CACHE_BYTES = 4 << 30  # up to this size a layer's gate and up pre-activations are computed once for target, init, refit and output


@dataclass(frozen=True)
class LayerwiseSettings:
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 512
    inputs: str = "teacher"  # teacher | student
    target: str = "mlp"  # mlp | stream (student inputs only)
    init: str = "split"  # lsq | split | split4 | none
    forward_batch: int = 4  # windows per layer forward
    target_zeros: float | None = None  # set each layer's dReLU threshold for this fraction of exact zeros before its refit
    seed: int = 0
    ridge: float = 1e-3  # the refit's lam as a fraction of the mean diagonal of H^T H
    weights: str = "uniform"  # uniform: plain squared error; stream: each token's weighted by 1 / its stream's mean square
    bf16_products: bool = False  # each layer's MLP work multiplies in bf16 with float32 accumulation (train/precision.py)


class _Capture(nn.Module):
    """Stands in for an MLP: records its input and adds nothing, so the layer returns its residual after attention."""

    def __init__(self):
        super().__init__()
        self.inputs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs = x
        return torch.zeros_like(x)


def _rotary(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    return model.model.rotary_emb(hidden, position_ids=positions)


@torch.no_grad()
def _attention_part(model, layer: int, stream: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run decoder layer `layer` without its MLP over the stream [N, S, H]: (MLP inputs [N, S, H], residual [N, S, H])."""
    block = model.model.layers[layer]
    mlp, capture = block.mlp, _Capture()
    xs, rs = [], []
    block.mlp = capture
    try:
        with float32_products():  # the inputs the MLP will see, as the model computes them
            for i in range(0, len(stream), batch):
                h = stream[i : i + batch]
                rs.append(block(h, attention_mask=None, position_embeddings=_rotary(model, h)))  # no mask: full causal windows
                xs.append(capture.inputs)
    finally:
        block.mlp = mlp
    return torch.cat(xs), torch.cat(rs)


@torch.no_grad()
def _apply(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mlp over x [T, H] in chunks."""
    return torch.cat([mlp(x[i : i + _CHUNK]) for i in range(0, len(x), _CHUNK)])


@torch.no_grad()
def _output(mlp: nn.Module, x: torch.Tensor, pre: list | None) -> torch.Tensor:
    """mlp over x [T, H]; pre: its pre-activations per chunk (_rebuild's, valid until Adam moves gate or up), so only
    down runs."""
    if pre is None:
        return _apply(mlp, x)
    return torch.cat([mlp.down_proj(mlp.activation(g, u)) for g, u in pre])


@torch.no_grad()
def _teacher_pass(teacher_mlp, x: torch.Tensor, keep: bool) -> tuple[torch.Tensor, list | None]:
    """The dense MLP's output y = down(act(gate(x)) * up(x)) on x [T, H], chunk by chunk, and (keep=True) each
    chunk's pre-activations (gate, up), which the init reads instead of computing them again."""
    ys, pre = [], [] if keep else None
    for i in range(0, len(x), _CHUNK):
        g, u = teacher_mlp.gate_proj(x[i : i + _CHUNK]), teacher_mlp.up_proj(x[i : i + _CHUNK])
        ys.append(teacher_mlp.down_proj(teacher_mlp.act_fn(g) * u))
        if keep:
            pre.append((g, u))
    return torch.cat(ys), pre


@torch.no_grad()
def _rebuild(student_mlp, teacher_mlp, x: torch.Tensor, w: torch.Tensor, init: str, pre: list | None,
             keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list | None]:  # fmt: skip
    """Rebuild gate and up from the teacher's (see the module docstring): each neuron reads one candidate (teacher
    neuron k, gate sign a, up sign b), a * gate_k and b * up_k, its down column starting as a * b * down_k. "lsq": every
    k once, a = 1, b the sign that keeps more of its SwiGLU output on x [T, H]; "split": the I of the 2I candidates
    with a = 1 of largest output energy, so a neuron whose output comes with both signs of up can keep both halves;
    "split4": the I of all 4I, energy measured on the SwiGLU output, so output made where the gate is negative (the
    silu's lobe) can be kept too. w [T]: token weights. pre: the teacher's pre-activations per chunk (_teacher_pass),
    turned into the student's in place; without them they are computed here, and kept when `keep`. Returns source
    [I], gate sign [I], up sign [I] and the student's pre-activations per chunk (or None: the refit computes them)."""
    wg, wu, wd = teacher_mlp.gate_proj.weight, teacher_mlp.up_proj.weight, teacher_mlp.down_proj.weight  # [I, H], [H, I]
    if any(getattr(m, "bias", None) is not None for m in (student_mlp.gate_proj, student_mlp.up_proj, student_mlp.down_proj)):
        raise SparseforgeError(f"layerwise_init: {init} needs MLPs without biases; set layerwise_init: none")
    width, picks = wg.shape[0], student_mlp.gate_proj.weight.shape[0]  # the teacher's neurons, the student's (2I with halves)
    if picks != width and init == "lsq":
        raise SparseforgeError(f"layerwise_init: lsq gives each of the teacher's {width} neurons one sign; this MLP has {picks} neurons "
                               "(neuron halves): use split")
    signs = [(1.0, 1.0), (1.0, -1.0)] + ([(-1.0, 1.0), (-1.0, -1.0)] if init == "split4" else [])  # (gate, up) per candidate block
    score = torch.zeros(len(signs), width, dtype=torch.float64, device=x.device)  # per (block, neuron)
    computed = pre is None
    if computed:
        pre = [] if keep else None
    for k, i in enumerate(range(0, len(x), _CHUNK)):
        g, u = (x[i : i + _CHUNK] @ wg.T, x[i : i + _CHUNK] @ wu.T) if computed else pre[k]  # [t, I]
        wt = w[i : i + _CHUNK, None]
        if init == "lsq":  # error against the SwiGLU output (less is better)
            s = F.silu(g) * u
            score[0] += (s - F.relu(g) * F.relu(u)).pow(2).mul_(wt).sum(0, dtype=torch.float64)
            score[1] += (s + F.relu(g) * F.relu(-u)).pow(2).mul_(wt).sum(0, dtype=torch.float64)
            del s
        else:  # output energy (more is better) in each candidate's region: relu(g)^2 u^2 (split), silu(g)^2 u^2 (split4)
            e = (F.relu(g) if init == "split" else F.silu(g)).mul_(u).square_()  # [t, I]
            for j, (a, b) in enumerate(signs):
                score[j] += (wt.T @ (e * ((a * g > 0) & (b * u > 0))))[0].double()
            del e
        if computed and keep:
            pre.append((g, u))
    if init == "lsq":
        source = torch.arange(width, device=x.device)
        gate_sign, up_sign = torch.ones(width, dtype=wu.dtype, device=x.device), torch.where(score[1] < score[0], -1.0, 1.0).to(wu.dtype)
    else:
        chosen = (score * wd.double().pow(2).sum(0)).flatten().topk(picks).indices.sort().values  # of [blocks * I], through down
        source, block = chosen % width, chosen // width
        table = torch.tensor(signs, dtype=wu.dtype, device=x.device)  # [blocks, 2]
        gate_sign, up_sign = table[block, 0], table[block, 1]
    student_mlp.gate_proj.weight.copy_(wg[source] * gate_sign[:, None])
    student_mlp.up_proj.weight.copy_(wu[source] * up_sign[:, None])
    for k, (g, u) in enumerate(pre or ()):  # the student's pre-activations
        pre[k] = (g[:, source].mul_(gate_sign), u[:, source].mul_(up_sign))
    return source, gate_sign, up_sign, pre


@torch.no_grad()
def _refit_down(student_mlp, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, d0: torch.Tensor, pre: list | None,
                ridge: float) -> None:  # fmt: skip
    """down by ridge least squares on all tokens (weighted by w [T]), shrunk towards d0 [H, I], through the student's
    activation (with its threshold): see the module docstring. pre: _rebuild's pre-activations (or None)."""
    width = d0.shape[1]
    hth = torch.zeros(width, width, dtype=torch.float64, device=x.device)
    yth = torch.zeros(d0.shape[0], width, dtype=torch.float64, device=x.device)
    for k, i in enumerate(range(0, len(x), _CHUNK)):
        g, u = pre[k] if pre is not None else (student_mlp.gate_proj(x[i : i + _CHUNK]), student_mlp.up_proj(x[i : i + _CHUNK]))
        h = student_mlp.activation(g, u)  # [t, I]
        hw = h * w[i : i + _CHUNK, None]
        hth += (hw.T @ h).double()
        yth += (y[i : i + _CHUNK].T @ hw).double()
    lam = ridge * hth.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(width, dtype=hth.dtype, device=hth.device)
    down = torch.linalg.solve(hth + lam * eye, (yth + lam * d0.double()).T).T  # [H, I]
    student_mlp.down_proj.weight.copy_(down.to(student_mlp.down_proj.weight.dtype))


@torch.no_grad()
def _set_threshold(mlp, x: torch.Tensor, target: float) -> dict:
    """Set the MLP's dReLU threshold for `target` exact zeros on x [T, H] (THRESHOLD_TOKENS of them, evenly strided),
    the order statistic `sparseforge threshold` uses. Returns {"threshold", "threshold_tokens", "zero_fraction_before"}."""
    act = mlp.activation
    act.threshold = 0.0
    xs = x[:: -(-len(x) // THRESHOLD_TOKENS)]
    store = LargestPositive(1, 1.0 - target, len(xs))
    for i in range(0, len(xs), _CHUNK):
        store.add(0, act(mlp.gate_proj(xs[i : i + _CHUNK]), mlp.up_proj(xs[i : i + _CHUNK])))
    store.prune(len(xs), final=True)
    act.threshold = store.threshold(0)
    return {"threshold": act.threshold, "threshold_tokens": len(xs), "zero_fraction_before": 1 - store.positive[0] / store.seen[0]}


@torch.no_grad()
def _zero_fraction(mlp, x: torch.Tensor) -> float:
    return float((mlp.activation(mlp.gate_proj(x), mlp.up_proj(x)) == 0).float().mean())


def token_weights(residual: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights [T] of the stage-1 objective (module docstring) from the residual after attention and the
    target, both [T, H]: `uniform` 1; `stream` 1 / the mean square of the stream after the layer, residual + y, so
    that an output error counts as much as it moves the normalized stream the next layer reads, scaled to mean 1."""
    if mode == "uniform":
        return torch.ones(len(y), dtype=y.dtype, device=y.device)
    w = 1.0 / (residual + y).pow(2).mean(-1).clamp_min(torch.finfo(y.dtype).tiny)
    return w / w.mean()


def _rel_err(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    return ((out - y).pow(2).sum(-1) @ w / (y.pow(2).sum(-1) @ w)).item()


def _rel_mse(mlp, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    return _rel_err(_apply(mlp, x), y, w)


def _fit(mlp, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, s: LayerwiseSettings, seed: int) -> None:
    """Adam on the MLP's weights: minimize sum_t w_t ||mlp(x_t) - y_t||^2 / sum_t w_t ||y_t||^2 over shuffled token
    batches. x, y: [T, H], w: [T]."""
    params = list(mlp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=s.lr)
    g = torch.Generator().manual_seed(seed)
    scale = (y.pow(2).sum(-1) @ w) / len(w)
    for _ in range(s.epochs):
        order = torch.randperm(len(x), generator=g).to(x.device)
        for i in range(0, len(x), s.batch_tokens):
            idx = order[i : i + s.batch_tokens]
            loss = ((mlp(x[idx]) - y[idx]).pow(2).sum(-1) @ w[idx]) / (len(idx) * scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def distill_layerwise(student, teacher, windows: torch.Tensor, settings: LayerwiseSettings, progress: bool = True) -> list[dict]:
    """Distill every student MLP towards its teacher MLP in place, layer by layer; returns per-layer stats.

    windows: [N, S] token ids of real text on the models' device. Returns
    [{"layer", "rel_mse_before", "rel_mse_after", "seconds", ...}], rel_mse = ||student - teacher||^2 / ||teacher||^2
    summed over DIAG_TOKENS of the layer's inputs, evenly strided (all of them when there are fewer), with the
    objective's token weights (token_weights).
    """
    s = settings
    if hasattr(student.model.layers[0].mlp, "experts"):
        raise SparseforgeError("layer-wise distillation supports dense-MLP models; for MoE set layerwise_tokens: 0")
    if (s.inputs not in ("teacher", "student") or s.init not in ("lsq", "split", "split4", "none") or s.target not in ("mlp", "stream")
            or s.weights not in ("stream", "uniform")):  # fmt: skip
        raise SparseforgeError(f"layer-wise settings inputs={s.inputs!r} init={s.init!r} target={s.target!r} weights={s.weights!r}; "
                               "use inputs teacher|student, init lsq|split|split4|none, target mlp|stream, weights stream|uniform")
    if s.target == "stream" and s.inputs != "student":
        raise SparseforgeError("layerwise_target: stream needs layerwise_inputs: student (with teacher inputs it is the mlp target)")
    was_training = student.training
    student.train(False)
    source = teacher if s.inputs == "teacher" else student  # whose layers make the MLP inputs
    with torch.no_grad():
        stream = source.model.embed_tokens(windows)  # [N, S, H]
        dense = teacher.model.embed_tokens(windows) if s.target == "stream" else None  # the teacher's stream
    stats = []
    with bf16_products(s.bf16_products):  # the MLPs' work (attention makes their inputs in float32: _attention_part)
        for l in tqdm(range(len(student.model.layers)), desc="layer-wise distillation", disable=not progress):
            start = time.perf_counter()
            x, residual = _attention_part(source, l, stream, s.forward_batch)
            x = x.reshape(-1, x.shape[-1])  # [T, H]
            teacher_mlp, mlp = teacher.model.layers[l].mlp, student.model.layers[l].mlp
            pre = None  # the teacher's and then the student's pre-activations, computed once for the target, init and output
            keep = s.init != "none" and 2 * len(x) * mlp.gate_proj.weight.shape[0] * x.element_size() <= LSQ_CACHE_BYTES
            if dense is None:
                y, pre = _teacher_pass(teacher_mlp, x, keep)  # [T, H]
            else:
                tx, tr = _attention_part(teacher, l, dense, s.forward_batch)
                dense = tr + _apply(teacher_mlp, tx.reshape(-1, tx.shape[-1])).reshape(tr.shape)
                y = (dense - residual).reshape(-1, x.shape[-1])
                del tx, tr
            w = token_weights(residual.reshape(y.shape), y, s.weights)
            probe = slice(None, None, -(-len(x) // DIAG_TOKENS))  # the diagnostics' tokens (training uses all of them)
            xp, yp, wp = x[probe], y[probe], w[probe]
            row = {"layer": l, "rel_mse_before": _rel_mse(mlp, xp, yp, wp)}
            if s.init != "none":
                picked, gate_sign, up_sign, pre = _rebuild(mlp, teacher_mlp, x, w, s.init, pre, keep)
            if s.target_zeros is not None:
                row.update(_set_threshold(mlp, x, s.target_zeros))
            if s.init != "none":
                _refit_down(mlp, x, y, w, teacher_mlp.down_proj.weight[:, picked] * (gate_sign * up_sign)[None, :], pre, s.ridge)
                row["flipped"] = int((up_sign < 0).sum())
                row["negative_gate"] = int((gate_sign < 0).sum())
                row["both_halves"] = int(len(picked) - picked.unique().numel())  # teacher neurons read with both signs
                row["rel_mse_init"] = _rel_mse(mlp, xp, yp, wp)
            if s.epochs:
                pre = None  # Adam moves gate and up
                _fit(mlp, x, y, w, s, s.seed + l)
                if s.target_zeros is not None:  # Adam moved the products: the threshold again, for the target exactly
                    row["threshold"] = _set_threshold(mlp, x, s.target_zeros)["threshold"]
            if s.target_zeros is not None:
                row["zero_fraction_after"] = _zero_fraction(mlp, xp)
            out = y if s.inputs == "teacher" else _output(mlp, x, pre)  # what the stream moves on with
            del pre
            row["rel_mse_after"] = _rel_mse(mlp, xp, yp, wp) if s.inputs == "teacher" else _rel_err(out[probe], yp, wp)
            stream = residual + out.reshape(residual.shape)
            del x, y, w, xp, yp, wp, out, residual
            row["seconds"] = time.perf_counter() - start
            stats.append(row)
    student.train(was_training)
    return stats
