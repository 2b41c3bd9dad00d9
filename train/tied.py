"""Tied neuron halves: each pair of halves keeps one gate row and one up row through training.

A model with neuron halves (sparsify.convert.split_halves) has 2I neurons per MLP: neuron i and neuron I + i are
(g, u, d) and (g, -u, -d) as converted. Trained freely, the pair's rows drift apart and a token reads four rows per
pair it computes. Tied, only the down columns are free:

    mlp(x) = D+ (relu(G x) relu(U x)) + D- (relu(G x) relu(-U x))

so gate row i equals gate row I + i and up row I + i is minus up row i, always. The checkpoint keeps the halves'
layout (any stage reads it as a plain 2I-neuron dReLU model); config.sparsity["tied_halves"] says whether every
pair is tied exactly.

Training keeps the tie without another parametrization: each gate (up) weight's gradient is replaced by the
gradient of the tied parameter, the sum (difference) of the pair's rows' gradients, on both rows (the second
negated for up). Starting tied, with equal (opposite) gradients and optimizer states, every elementwise optimizer
(SGD, Adam, AdamW with decay, clipping by a global norm) gives the two rows equal (opposite) updates, bit for bit.
A hook runs on each micro-step's gradient before it is accumulated, so data parallelism, which reduces the
accumulated gradients, keeps it too (DeepSpeed and FSDP, which partition parameters, are refused up front);
`untied_layers` checks the result before a checkpoint is written.

A tied MLP also computes only the first half's gate and up products (`SparseMLP.tied`, the modeling code), so the
second half's rows get no gradient of their own and the hooks give them the first half's. Only training sets it: a
loaded model computes every row, whatever its weights.
"""

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.sparsify.convert import tied_pairs


def _pairs(model) -> list:
    """The halves MLPs of `model` (config.sparsity["halves"]), one per layer."""
    if not (model.config.sparsity or {}).get("halves"):
        raise SparseforgeError("tied halves need a model with neuron halves; set neuron_halves: true (or convert with --halves)")
    return [layer.mlp for layer in model.model.layers]


def untied_layers(model) -> list[int]:
    """The layers of a halves model whose pairs are not tied exactly (gate rows equal, up rows opposite)."""
    return [i for i, mlp in enumerate(_pairs(model)) if not tied_pairs(mlp.gate_proj.weight, mlp.up_proj.weight)]


def _tied_grad(sign: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        half = grad.shape[0] // 2
        g = grad[:half] + sign * grad[half:]
        return torch.cat([g, sign * g])

    return hook


def tie_halves(model) -> list:
    """Tie every pair of `model`'s halves for training (module docstring); the pairs must be tied already, as
    conversion makes them. Returns the hook handles."""
    bad = untied_layers(model)
    if bad:
        raise SparseforgeError(f"tied_halves: the halves of layer(s) {bad[:5]} are not tied (trained apart); start from the dense "
                               "model or from a checkpoint trained with tied_halves: true, or set tied_halves: false")
    handles = []
    for mlp in _pairs(model):
        mlp.tied = True
        handles.append(mlp.gate_proj.weight.register_hook(_tied_grad(1.0)))
        handles.append(mlp.up_proj.weight.register_hook(_tied_grad(-1.0)))
    return handles
