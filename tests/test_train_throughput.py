"""benchmarks/train_throughput.py: its model FLOPs (N is every weight a token is multiplied by, counted here from the
modules themselves; neuron halves leave the teacher at its dense width, and tied halves compute one gate and one up
row per pair) and its --stage1 record."""

import copy

from torch import nn

from scripts import load_script
from sparseforge.sparsify.convert import convert_model
from tiny import tiny_model


def _linear_weights(model, skip_second_half: bool = False) -> int:
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            rows = module.weight.shape[0]
            if skip_second_half and name.endswith(("gate_proj", "up_proj")):
                rows //= 2
            total += rows * module.weight.shape[1]
    return total


def test_flops_count_the_computed_weights():
    bench = load_script("train_throughput")
    dense = tiny_model("llama")
    c = dense.config
    S = 64
    attention = 4 * c.num_hidden_layers * c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * S
    n_dense = _linear_weights(dense)
    plain = bench.flops_per_token(convert_model(copy.deepcopy(dense), "drelu").config, 1000, S, teacher=True)
    assert plain["matmul_params"] == n_dense
    assert plain["teacher"] == 2 * n_dense + attention
    assert plain["student"] == 4 * n_dense + 3 * attention + 2 * 1000

    halves = convert_model(copy.deepcopy(dense), "drelu", halves=True)
    params = sum(p.numel() for p in halves.parameters())
    untied = bench.flops_per_token(halves.config, params, S, teacher=True)
    assert untied["matmul_params"] == _linear_weights(halves) > n_dense
    assert untied["teacher"] == plain["teacher"]  # the dense original's width
    tied = bench.flops_per_token(halves.config, params, S, teacher=True, tied=True)
    n_tied = _linear_weights(halves, skip_second_half=True)
    assert tied["matmul_params"] == n_tied
    assert tied["student"] == 4 * n_tied + 3 * attention + 2 * (params - (_linear_weights(halves) - n_tied))
    assert tied["teacher"] == plain["teacher"]


def test_stage1_mode_records_time_precision_and_quality(workspace, tmp_path):
    """`--stage1` runs the recipe's stage 1 and its thresholds, no step, and writes their time, the precision of the fit's
    products, every layer's error and the validation loss before and after."""
    import json

    import yaml

    from tiny import tiny_recipe

    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "unused", layerwise_tokens=256, layerwise_epochs=1,
                                                 layerwise_batch_tokens=64, neuron_halves=True, target_zeros=0.8,
                                                 layerwise_thresholds=True, mixed_precision="no")))
    bench = load_script("train_throughput")
    out = tmp_path / "stage1"
    assert bench.main(["--config", str(config), "--stage1", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "stage1.json").read_text())
    assert result["tokens"] == 256 and result["bf16_products"] is False and result["environment"]["mixed_precision"] == "no"
    layers = len(result["rel_mse_after"])
    assert layers == len(result["layer_seconds"]) >= 1 and result["stage1_seconds"] >= sum(result["layer_seconds"]) * 0.99
    assert set(result["val_loss_after"]) == {"web", "code", "math"} and result["val_loss_after"] != result["val_loss_before"]
    assert "| float32 | 256 |" in (tmp_path / "stage1.md").read_text()
