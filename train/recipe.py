"""Training recipes: flat YAML, validated up front. An unknown key, a wrong type or an incompatible
combination is an error that names the key and the fix.

`--set key=value` overrides a key from the command line (the value is parsed as YAML, so
`--set max_steps=20`, `--set report_to=[wandb]`, `--set sources.web.weight=0.5` all work).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sparseforge.errors import SparseforgeError
from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS


@dataclass
class Recipe:
    """Every knob of a continued-pretraining run. Field comments are the documentation."""

    model: str  # dense source (alias, .gguf, HF dir, Hub id) converted on load, or a sparse checkpoint
    output_dir: str  # run directory: metrics.jsonl, state/step-N/ (resumable), checkpoint/ (the result)
    sources: dict  # name -> {path: glob (relative to data_root) | hub: dataset id | generated: {tokens, ...}, weight: float, text_field: str, max_tokens: int}
    activation: str = "drelu"  # MLP activation when `model` is dense
    threshold: float | None = None  # t for shifted_relu / fatrelu (all layers)
    data_root: str | None = None  # base for relative source globs; default $SPARSEFORGE_DATA or ../shared/data
    seq_len: int = 512  # tokens per packed sequence
    micro_batch_size: int = 4  # sequences per forward pass per process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 100  # optimizer steps end to end (0: stage 1 only)
    lr: float = 1e-4  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 1.0  # max gradient norm (0 = off)
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto: bf16 where the device multiplies bf16 natively (CUDA, CPUs with AMX), else no
    seed: int = 0  # model-independent seed: data order, dropout
    val_every: int = 50  # document i of a source is held out for validation (never trained on) when i % val_every == 0
    val_tokens: int = 4096  # validation tokens per source
    eval_every: int = 50  # steps between validation runs (also at step 0 and at the end)
    save_every: int = 50  # steps between resumable state saves (0 = only at the end)
    keep_states: int = 2  # resumable states kept on disk while training
    keep_final_state: bool = False  # keep state/ after the checkpoint is written (to extend the run with --resume); false frees its disk
    log_every: int = 1  # steps between metric lines
    report_to: list = field(default_factory=list)  # accelerate trackers, e.g. [wandb] (WANDB_MODE=offline works)
    lm_weight: float = 1.0  # weight of the next-token cross-entropy (0: distillation only)
    distill_kl: float = 0.0  # weight of KL(teacher || student) on logits; teacher = the dense original (0 = off)
    distill_temperature: float = 1.0  # softmax temperature of the distillation KL
    distill_hidden: float = 0.0  # weight of feature distillation: each layer's output vs the teacher's, squared error relative to the teacher's per token, mean over tokens and layers (0 = off)
    teacher: str | None = None  # dense teacher spec; default: `model` when it is dense
    teacher_dtype: str = "auto"  # auto: bfloat16 where the device multiplies bf16 natively (CUDA, CPUs with AMX), float32 elsewhere; or float32 | bfloat16 | float16
    trainable: str = "all"  # all | mlp (attention, norms and embeddings frozen)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    compile: bool = False  # torch.compile the decoder stack
    token_cache: str | None = None  # token stores; default $SPARSEFORGE_CACHE/tokens or ~/.cache/sparseforge/tokens
    l1_coef: float = 0.0  # final weight of the mean |activation| penalty (ProSparse); 0 = off
    l1_ramp_steps: int = 0  # the L1 weight rises linearly from 0 to l1_coef over these steps
    swap_steps: int = 0  # blend SwiGLU -> target activation over the first N steps (0 = swap at once)
    layerwise_tokens: int = 0  # tokens for layer-wise MLP distillation before end-to-end training (0 = off)
    layerwise_epochs: int = 4  # passes over those tokens per layer
    layerwise_lr: float = 1e-4  # Adam learning rate of layer-wise distillation
    layerwise_batch_tokens: int = 1024  # tokens per layer-wise optimizer step
    layerwise_inputs: str = "teacher"  # teacher: MLP inputs from the dense model; student: from already-distilled layers
    layerwise_target: str = "mlp"  # mlp: the dense MLP's output; stream: the dense model's stream minus the student's (student inputs)
    layerwise_ridge: float = 1e-3  # the init's refit of down: ridge towards the dense down, a fraction of the mean diagonal of H^T H
    layerwise_weights: str = "uniform"  # uniform: plain squared error of the MLP output; stream: each token's weighted by 1 / its stream's mean square after the layer
    neuron_halves: bool = False  # convert each SwiGLU neuron into its two dReLU halves, (g, u, d) and (g, -u, -d): MLPs twice as wide, computing ReGLU until thresholds (sparsify/convert.py)
    tied_halves: bool = False  # with neuron_halves: each pair keeps one gate row and one up row through training, only the down columns free (train/tied.py)
    layerwise_init: str = "split"  # lsq: per-neuron sign of (up, down), then down by least squares, before Adam; split: the I strongest of the 2I (neuron, sign) halves, then the same refit; split4: of the 4I (neuron, gate sign, up sign) quarters; none: as converted
    target_zeros: float | None = None  # dReLU thresholds set before end-to-end training for this fraction of exact zeros per layer, kept while training (null: none)
    layerwise_thresholds: bool = False  # true: stage 1 sets each layer's target_zeros threshold before refitting it; false: calibrated after stage 1
    layerwise_target_zeros: float | None = None  # with layerwise_thresholds: the zeros stage 1's thresholds are for, target_zeros' recalibrated after it (null: target_zeros)
    threshold_criterion: str = "product"  # what target_zeros thresholds compare: product (h) or contribution (h times the neuron's down-column norm; sparsify/threshold.py)
    threshold_allocation: str = "uniform"  # uniform: every layer at target_zeros; global: one cut over all layers, their zeros averaging it (thresholds after stage 1 only)
    device: str = "auto"  # auto: accelerate's choice; cpu forces CPU
    stages: dict = field(default_factory=dict)  # `sparseforge run`: extra arguments of the later stages (sparseforge/pipeline.py)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
_REQUIRED = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _set_override(raw: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise SparseforgeError(f"--set {assignment!r} is not key=value (example: --set max_steps=20)")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    target = raw
    for part in parts[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise SparseforgeError(f"--set {key}: {part!r} is not a mapping in the recipe")
    target[parts[-1]] = yaml.safe_load(value)


def _number(value):
    """A number written any way a person writes one: 1e-4 and 1_000 arrive from YAML 1.1 as strings."""
    if not isinstance(value, str):
        return value
    text = value.strip().replace("_", "")
    try:
        number = int(text) if text.lstrip("+-").isdigit() else float(text)
    except ValueError:
        return value
    return number if math.isfinite(number) else value  # nan / inf stay text and fail the type check


def _check_type(key: str, value, default):
    numeric = (int, float)
    if default is None or value is None:
        return value
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        value = _number(value)
        if isinstance(default, int) and isinstance(value, float) and value.is_integer():
            value = int(value)  # 1e6 tokens
    if isinstance(default, str) and isinstance(value, bool):
        value = "yes" if value else "no"  # YAML 1.1 reads an unquoted `no` (mixed_precision: no) as false
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, numeric) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
        value = type(default)(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise SparseforgeError(f"recipe key {key!r} must be {type(default).__name__}, got {value!r}")
    return value


def validate(recipe: Recipe) -> Recipe:
    """Range and compatibility checks; each failure names the key and what to do."""
    r = recipe
    if r.activation not in ACTIVATIONS:
        raise SparseforgeError(f"recipe key 'activation' is {r.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    for key in ("seq_len", "micro_batch_size", "gradient_accumulation_steps", "log_every", "keep_states", "val_every"):
        if getattr(r, key) < 1:
            raise SparseforgeError(f"recipe key {key!r} must be >= 1, got {getattr(r, key)}")
    for key in ("max_steps", "warmup_steps", "save_every", "eval_every", "val_tokens", "l1_ramp_steps", "swap_steps", "layerwise_tokens"):
        if getattr(r, key) < 0:
            raise SparseforgeError(f"recipe key {key!r} must be >= 0, got {getattr(r, key)}")
    for key in ("lr", "layerwise_lr", "layerwise_ridge", "distill_temperature"):
        if getattr(r, key) <= 0:
            raise SparseforgeError(f"recipe key {key!r} must be > 0, got {getattr(r, key)}")
    if not 0 <= r.min_lr_ratio <= 1:
        raise SparseforgeError(f"recipe key 'min_lr_ratio' must be in [0, 1], got {r.min_lr_ratio}")
    if r.mixed_precision not in ("no", "bf16", "fp16", "auto"):
        raise SparseforgeError(f"recipe key 'mixed_precision' is {r.mixed_precision!r}; use no, bf16, fp16 or auto")
    if r.layerwise_weights not in ("stream", "uniform"):
        raise SparseforgeError(f"recipe key 'layerwise_weights' is {r.layerwise_weights!r}; use stream or uniform")
    if r.layerwise_inputs not in ("teacher", "student"):
        raise SparseforgeError(f"recipe key 'layerwise_inputs' is {r.layerwise_inputs!r}; use teacher or student")
    if r.teacher_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise SparseforgeError(f"recipe key 'teacher_dtype' is {r.teacher_dtype!r}; use auto, float32, bfloat16 or float16")
    if r.trainable not in ("all", "mlp"):
        raise SparseforgeError(f"recipe key 'trainable' is {r.trainable!r}; use all or mlp")
    if min(r.lm_weight, r.distill_kl, r.distill_hidden) < 0 or r.lm_weight + r.distill_kl + r.distill_hidden == 0:
        raise SparseforgeError(f"recipe keys lm_weight ({r.lm_weight}), distill_kl ({r.distill_kl}) and distill_hidden ({r.distill_hidden}) "
                               "must be >= 0 and not all 0")
    if r.layerwise_target not in ("mlp", "stream"):
        raise SparseforgeError(f"recipe key 'layerwise_target' is {r.layerwise_target!r}; use mlp or stream")
    if r.layerwise_target == "stream" and r.layerwise_inputs != "student":
        raise SparseforgeError("recipe key 'layerwise_target' is stream but 'layerwise_inputs' is teacher; set layerwise_inputs: student")
    if r.layerwise_init not in ("lsq", "split", "split4", "none"):
        raise SparseforgeError(f"recipe key 'layerwise_init' is {r.layerwise_init!r}; use lsq, split, split4 or none")
    if r.neuron_halves:
        from sparseforge.sparsify.convert import check_halves

        check_halves(r.activation)
        if r.layerwise_init == "lsq" and r.layerwise_tokens:  # the init runs in stage 1 only
            raise SparseforgeError("neuron_halves needs every half of a neuron, layerwise_init lsq keeps one; use split, split4 or none")
    if r.tied_halves and r.layerwise_tokens and r.layerwise_init == "split4":
        raise SparseforgeError("tied_halves keeps each neuron's pair of halves, layerwise_init split4 chooses quarters; use split or none")
    if r.max_steps and r.warmup_steps > r.max_steps:
        raise SparseforgeError(f"warmup_steps ({r.warmup_steps}) exceeds max_steps ({r.max_steps}); lower warmup_steps")
    if r.target_zeros is not None and not 0 < r.target_zeros < 1:
        raise SparseforgeError(f"recipe key 'target_zeros' must be a fraction between 0 and 1 (e.g. 0.85) or null, got {r.target_zeros}")
    if r.layerwise_target_zeros is not None:
        if not 0 < r.layerwise_target_zeros < 1:
            raise SparseforgeError(f"recipe key 'layerwise_target_zeros' must be a fraction between 0 and 1 (e.g. 0.925) or null, got {r.layerwise_target_zeros}")
        if not (r.layerwise_thresholds and r.target_zeros is not None):
            raise SparseforgeError("recipe key 'layerwise_target_zeros' sets stage 1's thresholds before target_zeros' are calibrated after it; "
                                   "set layerwise_thresholds: true and target_zeros, or layerwise_target_zeros: null")
    from sparseforge.sparsify.threshold import ALLOCATIONS, CRITERIA

    if r.threshold_criterion not in CRITERIA:
        raise SparseforgeError(f"recipe key 'threshold_criterion' is {r.threshold_criterion!r}; use {' or '.join(CRITERIA)}")
    if r.threshold_allocation not in ALLOCATIONS:
        raise SparseforgeError(f"recipe key 'threshold_allocation' is {r.threshold_allocation!r}; use {' or '.join(ALLOCATIONS)}")
    if r.layerwise_thresholds and (r.threshold_allocation, r.threshold_criterion) != ("uniform", "product"):
        raise SparseforgeError("threshold_criterion and threshold_allocation apply to thresholds calibrated after stage 1; "
                               "with layerwise_thresholds: true keep product and uniform, or set layerwise_thresholds: false")
    if r.target_zeros is not None and r.activation != "drelu":
        raise SparseforgeError(f"recipe key 'target_zeros' sets dReLU thresholds; activation is {r.activation!r}: use activation drelu or target_zeros: null")
    if r.activation in ("shifted_relu", "fatrelu") and r.threshold is None:
        raise SparseforgeError(f"activation {r.activation} needs recipe key 'threshold'")
    if r.swap_steps and r.activation == "silu":
        raise SparseforgeError("swap_steps blends SwiGLU into a sparse activation; with activation silu set swap_steps: 0")
    if not r.sources:
        raise SparseforgeError("recipe key 'sources' is empty; give at least one source with a path and a weight")
    if all("generated" in src for src in r.sources.values() if isinstance(src, dict)):
        raise SparseforgeError("every source is generated; keep at least one file or Hub source (its text prompts the teacher and is the validation set)")
    for name, src in r.sources.items():
        if not isinstance(src, dict):
            raise SparseforgeError(f"source {name!r} must be a mapping with path (or hub) and weight, got {src!r}")
        unknown = set(src) - {"path", "hub", "generated", "weight", "text_field", "split", "name", "max_tokens"}
        if unknown:
            raise SparseforgeError(f"source {name!r} has unknown key(s) {sorted(unknown)}; allowed: path, hub, generated, weight, text_field, split, name, max_tokens")
        if sum(k in src for k in ("path", "hub", "generated")) != 1:
            raise SparseforgeError(f"source {name!r} needs exactly one of 'path' (local glob), 'hub' (dataset id) or 'generated' (teacher samples)")
        if "generated" in src:
            from sparseforge.train.teacher_text import check_generated

            src["generated"] = check_generated(name, src["generated"])
        cap = src.get("max_tokens")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0 or "generated" in src):
            raise SparseforgeError(f"source {name!r} max_tokens must be a positive integer on a path or hub source, got {cap!r}")
        weight = src.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise SparseforgeError(f"source {name!r} weight must be a positive number, got {weight!r}")
    return r


def load_recipe(path: str | Path | None = None, overrides: list[str] = (), raw: dict | None = None) -> Recipe:
    """Read a YAML recipe (or a dict), apply `key=value` overrides, validate."""
    if raw is None:
        path = Path(path)
        if not path.is_file():
            raise SparseforgeError(f"recipe {str(path)!r} does not exist; see recipes/ for examples")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise SparseforgeError(f"recipe {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    raw = dict(raw)
    for assignment in overrides:
        _set_override(raw, assignment)
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise SparseforgeError(f"unknown recipe key(s) {unknown}; valid keys: {', '.join(_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise SparseforgeError(f"recipe is missing required key(s) {missing}")
    values = {}
    for key, value in raw.items():
        f = _FIELDS[key]
        default = f.default if f.default is not dataclasses.MISSING else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        values[key] = _check_type(key, value, default) if key not in _REQUIRED else value
    return validate(Recipe(**values))
