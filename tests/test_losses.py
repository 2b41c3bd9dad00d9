"""The chunked distillation loss against the same loss through full logits, values and gradients."""

import pytest
import torch

from sparseforge.train.losses import IGNORE, ce_sum, distill_loss, reference_loss
from sparseforge.train.objective import LayerTap, Objective, teacher_outputs


@pytest.mark.parametrize("temperature,ce_weight,kl_weight,teacher,weight_grad", [
    (1.0, 1.0, 1.0, True, True),
    (2.0, 1.0, 0.5, True, True),
    (1.0, 0.0, 1.0, True, False),  # KL only, frozen output embeddings
    (1.0, 1.0, 0.0, False, True),  # CE only
])
def test_fused_equals_reference(temperature, ce_weight, kl_weight, teacher, weight_grad):
    g = torch.Generator().manual_seed(0)
    n, h, v = 45, 16, 97
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).requires_grad_(weight_grad)
    t_hidden, t_weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGNORE
    inputs = [hidden] + ([weight] if weight_grad else [])
    args = (labels, t_hidden if teacher else None, t_weight if teacher else None, temperature, ce_weight, kl_weight)
    fused = distill_loss(hidden, weight, *args, chunk=8)  # 45 tokens: 5 full chunks and a ragged one
    plain = reference_loss(hidden, weight, *args)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(fused[0] * 1.7, inputs), torch.autograd.grad(plain[0] * 1.7, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ce_sum_counts_labelled_positions():
    hidden, weight = torch.randn(10, 4), torch.randn(7, 4)
    labels = torch.tensor([1, 2, 3, IGNORE, 4, 5, 6, 0, 1, IGNORE])
    total, count = ce_sum(hidden, weight, labels, chunk=3)
    assert int(count) == 8
    torch.testing.assert_close(total / count, reference_loss(hidden, weight, labels)[1])


def test_feature_distillation_is_the_normalized_error_of_every_layer_output():
    """The teacher's tapped layer outputs are transformers' hidden states; Objective's feature term is
    the mean over layers and tokens of |s - t|^2 / |t|^2, added with its weight, with a gradient, and zero for the teacher itself."""
    from tiny import tiny_model

    from sparseforge.sparsify.convert import convert_model

    teacher = tiny_model("llama", layers=3)
    student = convert_model(tiny_model("llama", layers=3), "drelu")
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    tap = LayerTap(teacher)
    t_hidden, t_weight, t_layers = teacher_outputs(teacher, ids, tap)
    hidden_states = [h.flatten(0, 1) for h in teacher.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states]
    assert tap.outputs == []  # the hooks stay registered but record only under `with tap:`
    assert len(t_layers) == 3 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(t_layers[:2], hidden_states[1:3]))
    torch.testing.assert_close(teacher.model.norm(t_layers[2]), hidden_states[3])  # the last layer's, before the final norm

    objective = Objective(student, 1.0, 0.5, 1.0, chunk=5, hidden_weight=2.0)
    loss, ce, kl, feat = objective(ids, t_hidden, t_weight, t_layers)
    s_layers = LayerTap(student)
    with s_layers:
        student.model(input_ids=ids, use_cache=False)
    expected = sum(((s - t).pow(2).sum(1) / t.pow(2).sum(1)).mean() for s, t in zip(s_layers.take(), t_layers)) / 3
    assert feat.item() == pytest.approx(expected.item(), rel=1e-5) and feat > 0
    assert loss.item() == pytest.approx((ce + 0.5 * kl + 2.0 * feat).item(), rel=1e-5)
    assert torch.autograd.grad(loss, student.model.layers[0].mlp.gate_proj.weight)[0].abs().sum() > 0
    same = Objective(teacher, 1.0, 0.0, 1.0, hidden_weight=1.0)(ids, t_hidden, t_weight, t_layers)[3]
    assert same.item() == pytest.approx(0.0, abs=1e-10)
