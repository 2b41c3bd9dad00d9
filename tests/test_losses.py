"""The chunked distillation loss against the same loss through full logits, values and gradients."""

import pytest
import torch

from sparseforge.train.losses import IGNORE, ce_sum, distill_loss, reference_loss


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
