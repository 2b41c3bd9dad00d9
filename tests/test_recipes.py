"""Every shipped recipe and accelerate config validates; bad recipes fail early, naming the key."""

from pathlib import Path

import pytest
import torch
import yaml

from sparseforge.errors import SparseforgeError
from sparseforge.train.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
ACCELERATE = sorted((Path(__file__).resolve().parent.parent / "recipes" / "accelerate").glob("*.yaml"))


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"smollm2-135m-drelu", "mistral-7b-drelu", "llama3.1-8b-drelu", "qwen2.5-7b-drelu", "mixtral-8x7b-drelu"} <= names
    assert {"cpu", "ddp", "zero2", "zero3", "fsdp"} <= {p.stem for p in ACCELERATE}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_documents_itself(path):
    recipe = load_recipe(path)
    header = path.read_text().split("\n\n")[0]
    assert "accelerate launch" in header and "-m sparseforge.train --config recipes/" + path.name in header
    assert "--set" in header  # an override example
    for line in path.read_text().splitlines():  # a comment per knob
        if line and not line.startswith(("#", " ")):
            assert "#" in line, f"{path.name}: no comment on {line!r}"
    assert recipe.activation == "drelu"


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP"}
    if config["distributed_type"] == "DEEPSPEED":
        assert config["deepspeed_config"]["zero_stage"] in (2, 3)


def test_deepspeed_configs_match_their_recipes():
    for recipe_name, accel in [("mistral-7b-drelu", "zero2"), ("llama3.1-8b-drelu", "zero3"), ("mixtral-8x7b-drelu", "zero3")]:
        recipe = load_recipe(Path(RECIPES[0]).parent / f"{recipe_name}.yaml")
        ds = yaml.safe_load((Path(RECIPES[0]).parent / "accelerate" / f"{accel}.yaml").read_text())["deepspeed_config"]
        assert ds["gradient_accumulation_steps"] == recipe.gradient_accumulation_steps
        assert ds["gradient_clipping"] == recipe.grad_clip


BASE = {"model": "m", "output_dir": "o", "sources": {"web": {"path": "x/*.jsonl", "weight": 1.0}}}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"learning_rate": 1e-4}, r"unknown recipe key\(s\) \['learning_rate'\]"),
        ({"max_steps": "ten"}, "'max_steps' must be int, got 'ten'"),
        ({"max_steps": -1}, "'max_steps' must be >= 0, got -1"),
        ({"lr": -1.0}, "'lr' must be > 0"),
        ({"layerwise_ridge": 0.0}, "'layerwise_ridge' must be > 0, got 0.0"),
        ({"activation": "gelu"}, "'activation' is 'gelu'"),
        ({"mixed_precision": "fp8"}, "'mixed_precision' is 'fp8'"),
        ({"warmup_steps": 500, "max_steps": 10}, "warmup_steps \\(500\\) exceeds max_steps \\(10\\)"),
        ({"activation": "fatrelu"}, "needs recipe key 'threshold'"),
        ({"activation": "silu", "swap_steps": 10}, "set swap_steps: 0"),
        ({"sources": {}}, "'sources' is empty"),
        ({"sources": {"web": {"path": "a", "hub": "b"}}}, "exactly one of 'path'"),
        ({"sources": {"web": {"path": "a", "weight": 0}}}, "weight must be a positive number"),
        ({"sources": {"web": {"path": "a", "wieght": 1}}}, r"unknown key\(s\) \['wieght'\]"),
        ({"sources": {"web": {"path": "a", "max_tokens": -5}}}, "'web' max_tokens must be a positive integer on a path or hub source, got -5"),
        ({"layerwise_inputs": "both"}, "'layerwise_inputs' is 'both'"),
        ({"layerwise_weights": "tokens"}, "'layerwise_weights' is 'tokens'; use stream or uniform"),
    ],
)
def test_bad_recipes(change, message):
    with pytest.raises(SparseforgeError, match=message):
        load_recipe(raw={**BASE, **change})


def test_missing_required_and_overrides(tmp_path):
    with pytest.raises(SparseforgeError, match=r"missing required key\(s\) \['output_dir'\]"):
        load_recipe(raw={"model": "m", "sources": BASE["sources"]})
    recipe = load_recipe(raw=BASE, overrides=["max_steps=17", "sources.web.weight=0.5", "report_to=[wandb]"])
    assert recipe.max_steps == 17 and recipe.sources["web"]["weight"] == 0.5 and recipe.report_to == ["wandb"]
    assert load_recipe(raw=BASE, overrides=["mixed_precision=no"]).mixed_precision == "no"  # YAML 1.1 reads `no` as false
    with pytest.raises(SparseforgeError, match="'mixed_precision' is 'yes'"):
        load_recipe(raw=BASE, overrides=["mixed_precision=yes"])
    with pytest.raises(SparseforgeError, match="is not key=value"):
        load_recipe(raw=BASE, overrides=["max_steps"])
    with pytest.raises(SparseforgeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("amx", [True, False])
def test_auto_precision_takes_bf16_where_the_cpu_multiplies_it_natively(monkeypatch, amx):
    """mixed_precision and teacher_dtype `auto`: bf16 on a CPU with AMX and AVX-512 BF16, float32 on one without;
    explicit settings are kept."""
    from sparseforge.train import precision

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cpu = torch.device("cpu")
    assert load_recipe(raw=BASE, overrides=["mixed_precision=auto"]).mixed_precision == "auto"
    assert precision.resolve_mixed_precision("auto", cpu) == ("bf16" if amx else "no")
    assert precision.resolve_mixed_precision("no", cpu) == "no" and precision.resolve_mixed_precision("bf16", cpu) == "bf16"
    assert precision.device_settings(cpu, "auto")["teacher_dtype"] == (torch.bfloat16 if amx else torch.float32)
    assert precision.device_settings(cpu, "float32")["teacher_dtype"] == torch.float32
    assert precision.stage1_bf16_products("bf16", cpu) is amx  # stage 1 multiplies in bf16 only where it is native
    assert not precision.stage1_bf16_products("no", cpu)


def test_bf16_products_multiply_in_bf16_and_restore_the_setting():
    """Inside `bf16_products(True)` float32 matmuls use oneDNN's bf16 fpmath mode (float32 tensors in and out), and
    `float32_products()` inside it multiplies in float32 again; each previous mode comes back afterwards, also after an
    error; `bf16_products(False)` and `float32_products()` outside one change nothing."""
    from sparseforge.train.precision import bf16_products, float32_products

    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    with bf16_products(False), float32_products():
        assert matmul.fp32_precision == before
    with pytest.raises(RuntimeError):
        with bf16_products(True):
            assert matmul.fp32_precision == "bf16"
            a = torch.randn(64, 64)
            assert (a @ a).dtype == torch.float32
            with float32_products():
                assert matmul.fp32_precision == "ieee"
            assert matmul.fp32_precision == "bf16"
            raise RuntimeError("inside")
    assert matmul.fp32_precision == before
