"""Conversion: a dense SwiGLU model becomes a sparse model with the same weights and key names.

Only the MLP activation changes (see hf_code/modeling_sparseforge.py for the kinds); with
`activation="silu"` the converted model computes exactly what the original does.
"""

import torch

from sparseforge.checkpoint import sparse_config
from sparseforge.errors import SparseforgeError
from sparseforge.families import family_for, is_sparse
from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS

THRESHOLDED = ("shifted_relu", "fatrelu")


def parse_thresholds(value: str | None, activation: str, num_layers: int) -> list[float] | None:
    """`--threshold` -> per-layer list. Accepts one number (all layers) or one per layer, comma-separated."""
    if activation not in THRESHOLDED:
        if value is not None:
            raise SparseforgeError(f"--threshold applies to {' and '.join(THRESHOLDED)} only, not to --activation {activation}")
        return None
    if value is None:
        raise SparseforgeError(f"--activation {activation} needs --threshold T (one number, or {num_layers} comma-separated)")
    try:
        values = [float(v) for v in value.split(",")]
    except ValueError:
        raise SparseforgeError(f"--threshold {value!r} is not a number or a comma-separated list of numbers") from None
    if len(values) == 1:
        values = values * num_layers
    if len(values) != num_layers:
        raise SparseforgeError(f"--threshold has {len(values)} values; the model has {num_layers} layers: give 1 or {num_layers}")
    return values


def convert_model(model, activation: str, thresholds: list[float] | None = None, source: str | None = None, halves: bool = False):
    """Dense HF causal LM -> sparseforge sparse model sharing the same tensors (no copy).

    The sparse model is built on the meta device and takes the original's parameters and buffers by
    name, so conversion costs no extra weight memory and fails loudly if any key differs. `source` (the
    dense model spec) is recorded in config.sparsity["source"]. halves (dReLU only): every neuron becomes its two
    halves (`split_halves`), so the MLPs are twice as wide (new tensors).
    """
    if activation not in ACTIVATIONS:
        raise SparseforgeError(f"unknown --activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if is_sparse(model.config):
        raise SparseforgeError("the model is already a sparseforge sparse model; convert its dense original instead")
    family = family_for(model.config.model_type)
    config = sparse_config(model.config, activation, thresholds, source)
    _, model_cls = family.classes()
    with torch.device("meta"):
        sparse = model_cls(config)
    state = model.state_dict()
    missing, unexpected = sparse.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise SparseforgeError(f"weights do not map one to one: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, buffer in model.named_buffers():  # non-persistent buffers (rotary inv_freq) are not in state_dict
        owner, _, attr = name.rpartition(".")
        sparse.get_submodule(owner)._buffers[attr] = buffer
    if config.tie_word_embeddings:
        sparse.tie_weights()
    on_meta = [n for n, t in list(sparse.named_parameters()) + list(sparse.named_buffers()) if t.is_meta]
    if on_meta:
        raise SparseforgeError(f"conversion left tensors uninitialized: {on_meta[:5]}")
    sparse.generation_config = model.generation_config
    if halves:
        split_halves(sparse)
    return sparse.eval()


def check_halves(activation: str) -> None:
    if activation != "drelu":
        raise SparseforgeError(f"neuron halves split dReLU neurons; the activation is {activation}: use drelu")


@torch.no_grad()
def split_halves(model) -> None:
    """Make every neuron of a dReLU model's MLPs two: gate g, up u, down d become (g, u, d) and (g, -u, -d). Since
    relu(g) relu(u) d + relu(g) relu(-u) (-d) = relu(g) u d, the model then computes ReLU-gated MLPs (ReGLU: the
    original's silu(gate) taken as relu(gate), nothing else lost), with 2I neurons of which at most one per pair fires;
    thresholds and training then choose per token which halves are worth computing. Dense MLPs only."""
    from sparseforge.sparsify.hf_code.modeling_sparseforge import SparseMLP

    sparsity = model.config.sparsity or {}
    check_halves(sparsity.get("activation"))
    if any(sparsity.get("thresholds") or []):
        raise SparseforgeError("neuron halves split a model without thresholds; split it before `sparseforge threshold`")
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, SparseMLP) or mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise SparseforgeError(f"layer {i}: neuron halves need dense MLPs without gate/up biases (MoE experts and biased MLPs are not split)")
        g, u, d = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight  # [I, H], [I, H], [H, I]
        wide = SparseMLP(g.shape[1], 2 * g.shape[0], False, mlp.activation).to(device=g.device, dtype=g.dtype)
        wide.gate_proj.weight.copy_(torch.cat([g, g]))
        wide.up_proj.weight.copy_(torch.cat([u, -u]))
        wide.down_proj.weight.copy_(torch.cat([d, -d], dim=1))
        if mlp.down_proj.bias is not None:
            wide.down_proj.bias = torch.nn.Parameter(mlp.down_proj.bias.detach().clone())
        layer.mlp = wide
    model.config.intermediate_size = 2 * model.config.intermediate_size
    model.config.sparsity = {**sparsity, "halves": True, "tied_halves": True}  # each pair's gate and up rows one (train/tied.py)


def tied_pairs(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the rows of one MLP's gate and up [2I, ...] are tied halves (train/tied.py): row I + i of gate equals row
    i, row I + i of up is minus row i, exactly."""
    half = gate.shape[0] // 2
    return gate.shape[0] == 2 * half > 0 and torch.equal(gate[:half], gate[half:]) and torch.equal(up[:half], -up[half:])


def model_card(source: str, config) -> str:
    """A short model card; the scorecard stage replaces it with a fuller one."""
    s = config.sparsity
    trained, layerwise = s.get("trained_tokens", 0), s.get("layerwise_tokens", 0)
    history = (f"Trained after conversion (sparseforge train): layer-wise MLP distillation on {layerwise:,} tokens, then\n"
               f"{trained:,} tokens of continued pretraining end to end."
               if trained or layerwise else "Not trained after conversion: quality is that of the converted weights.")
    return f"""---
library_name: transformers
tags: [sparseforge, activation-sparsity, {s['activation']}]
---
# {s['activation']} conversion of `{source}`

Converted by sparseforge: the SwiGLU MLPs of this `{s['base_model_type']}` model use the
`{s['activation']}` activation; weights and key names are those of the base architecture.
{history}

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(PATH_OR_REPO, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(PATH_OR_REPO, trust_remote_code=True)
```
"""
