"""Layer-wise MLP distillation: each sparse MLP learns to reproduce its dense SwiGLU original.

For layer l, inputs x are the MLP inputs (after the post-attention norm) on real text, taken either from
the dense teacher (`inputs="teacher"`: one teacher forward captures every layer) or from the student with
layers < l already distilled (`inputs="student"`: one partial student forward per layer, so each layer
learns to correct the drift of the ones before it). The target is the teacher MLP's output on the same x.
Only the MLP's own weights train (a few million parameters per layer), which is why this costs minutes
where end-to-end training of the whole model costs hours on a CPU. Dense-MLP families only.
"""

import time

import torch
from tqdm.auto import tqdm

from sparseforge.errors import SparseforgeError


class _Stop(Exception):
    pass


def _capture_mlp_inputs(model, layers: list[int], windows: torch.Tensor, batch: int, stop_at: int | None = None) -> dict[int, torch.Tensor]:
    """MLP inputs of `layers` for all windows: {l: [N*S, H]}. Stops the forward after layer stop_at."""
    captured: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    handles = []
    for l in layers:
        def hook(module, args, l=l):
            captured[l].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            if stop_at is not None and l == stop_at:
                raise _Stop
        handles.append(model.model.layers[l].mlp.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch):
                try:
                    model(windows[start : start + batch], use_cache=False)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    return {l: torch.cat(v) for l, v in captured.items()}


def _fit_layer(student_mlp, teacher_mlp, x: torch.Tensor, epochs: int, lr: float, batch_tokens: int, seed: int) -> dict:
    """Adam on student_mlp's weights: minimize ||student(x) - teacher(x)||^2. x: [T, H]."""
    params = [p for p in student_mlp.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y = torch.cat([teacher_mlp(x[i : i + 4096]) for i in range(0, len(x), 4096)])  # [T, H]
        scale = y.pow(2).mean()

    def rel_mse() -> float:
        with torch.no_grad():
            err = sum((student_mlp(x[i : i + 4096]) - y[i : i + 4096]).pow(2).sum().item() for i in range(0, len(x), 4096))
        return err / (y.numel() * scale.item())

    before = rel_mse()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_tokens):
            idx = order[i : i + batch_tokens]
            loss = (student_mlp(x[idx]) - y[idx]).pow(2).mean() / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {"rel_mse_before": before, "rel_mse_after": rel_mse()}


def distill_layerwise(student, teacher, windows: list[list[int]], epochs: int, lr: float, batch_tokens: int,
                      inputs: str = "teacher", forward_batch: int = 4, seed: int = 0, progress: bool = True) -> list[dict]:
    """Distill every student MLP towards its teacher MLP in place; returns per-layer stats.

    windows: token-id windows of real text ([N, S] once stacked). Returns
    [{"layer", "rel_mse_before", "rel_mse_after", "seconds"}], rel_mse = ||student - teacher||^2 / ||teacher||^2.
    """
    if hasattr(student.model.layers[0].mlp, "experts"):
        raise SparseforgeError("layer-wise distillation supports dense-MLP models; for MoE set layerwise_tokens: 0")
    ids = torch.tensor(windows, device=next(student.parameters()).device)  # [N, S]
    num_layers = len(student.model.layers)
    teacher_inputs = _capture_mlp_inputs(teacher, list(range(num_layers)), ids, forward_batch) if inputs == "teacher" else None
    stats = []
    student.train(False)
    for l in tqdm(range(num_layers), desc="layer-wise distillation", disable=not progress):
        start = time.perf_counter()
        if teacher_inputs is not None:
            x = teacher_inputs.pop(l)
        else:
            x = _capture_mlp_inputs(student, [l], ids, forward_batch, stop_at=l)[l]
        row = _fit_layer(student.model.layers[l].mlp, teacher.model.layers[l].mlp, x, epochs, lr, batch_tokens, seed + l)
        stats.append({"layer": l, **row, "seconds": time.perf_counter() - start})
    return stats
