"""The loaded model: config, tokenizer, weights (runtime/weights.py), predictors, the lm_head's screen
(runtime/head.py) and the settings it runs with. Everything a forward step reads; nothing here computes.

    model = load_model(ckpt, mode="auto")   # "auto" | "sparse" | "screen" | "oracle" | "dense"

MLP modes:
- "dense": every neuron, with plain matmuls over [I, H] matrices (the fair baseline);
- "oracle": every neuron through the bundle kernels, keeping exactly those that fire (equals dense up to float
  rounding; a parity check for the sparse path);
- "sparse": the checkpoint's predictors (reading the residual after attention, before the MLP norm) choose the
  neurons; only those are computed;
- "screen": no predictor: an int8 copy of the gate (and up) rows proves most non-firing neurons zero with a rigorous
  bound, the rest are computed as in "oracle" (equals it up to float rounding; runtime/screen.py).

"auto" is resolved at load (`auto_mode`): "screen" where it applies (every MLP's activation has a gate sign to
screen, float weights, no device tier, no predictor dtype asked for; under a neuron store's placement plan, when the
plan reserved the MLP screens); with int8 weights, "oracle" for tied neuron halves under the same conditions with
every neuron resident; else "sparse". The screen is exact and needs no
predictors; where both were timed it decoded at 0.95-1.25x the predictors' speed (docs/runtime.md, "Modes").
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.files import damaged, read_json
from sparseforge.runtime import kernels
from sparseforge.runtime.forward import AttentionShape, attention_shape, rope_tables
from sparseforge.runtime.head import FLOAT_DTYPES, HeadScreen, screen_bytes
from sparseforge.runtime.screen import SCREENED, load_screens, screen_applies, screens_nbytes
from sparseforge.runtime.sizes import check_kv_dtype
from sparseforge.runtime.weights import ModelWeights, WeightReader, load_unit_predictors, load_weights, predictors_nbytes
from sparseforge.sparsify.hf_code.modeling_sparseforge import GatedActivation

MODES = ("sparse", "oracle", "dense", "screen")
AUTO = "auto"  # resolved at load to "screen", "oracle" or "sparse" (auto_mode)


@dataclass
class Model:
    """A checkpoint read for the engine. predictors: per (layer, expert) (sparse mode), else None."""

    ckpt: Path
    config: object
    tokenizer: object
    weights: ModelWeights
    predictors: dict | None
    mode: str
    context: int
    threads: int
    weight_dtype: str
    native: bool
    head_screen: HeadScreen | None
    units: Callable | None = None  # the units factory the MLPs came from (None: resident bundles or dense matrices)
    screens: dict | None = None  # per (layer, expert): runtime/screen.py UnitScreen (screen mode)
    device_tier: object = None  # runtime/hybrid.py DeviceTier: the hybrid engine's fast device (None: everything on the CPU)
    kv_dtype: str = "float32"  # the KV cache's element type (runtime/forward.py KV_DTYPES)
    shape: AttentionShape = field(init=False)
    cos: torch.Tensor = field(init=False)  # [context, head_dim]
    sin: torch.Tensor = field(init=False)
    activations: list = field(init=False)  # per layer: GatedActivation
    moe: bool = field(init=False)
    top_k: int = field(init=False)  # experts per token (1 without MoE)

    def __post_init__(self):
        self.shape = attention_shape(self.config)
        self.cos, self.sin = rope_tables(self.config, self.context)
        if self.device_tier is not None:
            self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        sparsity = self.config.sparsity
        thresholds = sparsity.get("thresholds") or [0.0] * self.config.num_hidden_layers
        self.activations = [GatedActivation(sparsity["activation"], t) for t in thresholds]
        self.moe = self.weights.layers[0].router is not None
        self.top_k = int(getattr(self.config, "num_experts_per_tok", 1) or 1) if self.moe else 1

    @property
    def device(self) -> torch.device:
        """Where the non-MLP weights, the KV cache and the hot neurons live (the CPU unless a hybrid engine)."""
        return torch.device("cpu") if self.device_tier is None else self.device_tier.device

    @property
    def predictor_dtype(self) -> str | None:
        """The predictors' dtype name (None: no predictors in this mode)."""
        p = next((p for p in (self.predictors or {}).values() if p is not None), None)
        return None if p is None else str(p.fc1[0].dtype).removeprefix("torch.")

    def resident_bytes(self) -> int:
        """Weights, predictors and head screen held in memory."""
        screen = self.head_screen.nbytes if self.head_screen is not None else 0
        device = 0 if self.device_tier is None else sum(lw.units[0].device_bytes for lw in self.weights.layers)  # hot neurons
        return self.weights.resident_bytes() + predictors_nbytes(self.predictors or {}) + screen + screens_nbytes(self.screens) + device

    def stop_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS id(s) and the checkpoint's generation_config eos_token_id(s)."""
        path = self.ckpt / "generation_config.json"
        generation_eos = read_json(path).get("eos_token_id") if path.is_file() else None
        ids = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.config, "eos_token_id", None), generation_eos):
            if value is not None:
                ids.update(value if isinstance(value, list | tuple) else [value])
        return tuple(sorted(int(i) for i in ids))


def load_model(ckpt: str | Path, mode: str = "auto", weight_dtype: str = "float32", context: int = 2048, threads: int | None = None,
               units: Callable | None = None, progress: bool = True, native: bool | None = None, predictor_dtype: str | None = None,
               head_screen: bool | None = None, device: str | None = None, device_memory: str | None = None, kv_dtype: str = "float32") -> Model:
    """Read a sparse checkpoint; the arguments are Engine.load's (runtime/engine.py)."""
    from sparseforge.sources import checkpoint_tokenizer

    ckpt = Path(ckpt)
    if mode not in (*MODES, AUTO):
        raise SparseforgeError(f"unknown mode {mode!r}; use one of {', '.join((AUTO, *MODES))}")
    if context < 1:
        raise SparseforgeError(f"context={context} must be at least 1 token")
    check_kv_dtype(kv_dtype)
    if threads is not None:
        if threads < 1:
            raise SparseforgeError(f"threads={threads} must be at least 1")
        torch.set_num_threads(threads)
    threads = threads or torch.get_num_threads()
    config = _load_config(ckpt)
    plan = getattr(units, "plan", None)  # a neuron store's placement plan: its reserve must hold the predictors or screens and the head screen
    if mode == AUTO:
        mode = auto_mode(config.sparsity, weight_dtype, device=device is not None or device_memory is not None,
                         predictors=predictor_dtype is not None, plan=plan)  # fmt: skip
    _check_plan_mode(plan, mode)
    tier = None
    if device is not None or device_memory is not None:
        from sparseforge.runtime.hybrid import DeviceTier, SplitUnits, device_plan, resolve_device
        from sparseforge.runtime.store import NeuronStore

        if units is not None and not isinstance(units, NeuronStore):
            raise SparseforgeError("the device tier (device, device_memory) takes its cold neurons from memory or from a neuron store "
                                   "(runtime/store.py), not from another units factory")  # fmt: skip
        if head_screen:
            raise SparseforgeError("head_screen=True: a hybrid engine computes the lm_head on its device, without the CPU's int8 screen; load with head_screen=None")
        tier = DeviceTier(resolve_device(device or "cpu"), device_plan(ckpt, device_memory or "100%", weight_dtype, context, kv_dtype))
        head_screen = False
    predictors = _load_predictors(ckpt, config, predictor_dtype or weight_dtype, plan) if mode == "sparse" else None
    reader = WeightReader(ckpt, weight_dtype)
    available = kernels.native() is not None
    if native and not available:
        raise SparseforgeError("native=True but the native kernels did not build (see the warning above); install a C compiler (cc)")
    native = available if native is None else native
    if tier is not None:
        units = SplitUnits(tier.plan, tier.device, threads, native, store=units)
    with torch.inference_mode():
        weights = load_weights(reader, config, mode, units, threads, native, progress)
        screen = _head_screen(weights, plan, threads, native, head_screen)
        if tier is not None:
            from sparseforge.runtime.hybrid import move_weights

            move_weights(weights, tier.device)
    tokenizer = checkpoint_tokenizer(str(ckpt), config)
    model = Model(ckpt, config, tokenizer, weights, predictors, mode, context, threads, weight_dtype, native, screen, units, device_tier=tier,
                  kv_dtype=kv_dtype)
    if mode == "screen":
        with torch.inference_mode():
            model.screens = load_screens(reader, model)
        need, have = screens_nbytes(model.screens), (plan or {}).get("always_touched", {}).get("mlp_screens", 0)
        if plan is not None and need > have:
            raise SparseforgeError(f"the plan for {plan['fast_memory']} reserves {have} B for the MLP screens, they take {need} B; make the plan "
                                   f"again: sparseforge plan {ckpt} --fast-memory {plan['fast_memory']} --mode screen")  # fmt: skip
    return model


def auto_mode(sparsity: dict | None, weight_dtype: str, device: bool = False, predictors: bool = False, plan: dict | None = None) -> str:
    """The mode "auto" runs for a checkpoint's `sparsity` (config.json): "screen" when every MLP's activation is one a
    gate bound proves zero and the weights are float (runtime/screen.py screen_applies), there is no device tier (its
    plans hold predictors) and no predictor dtype was asked for (predictors); under a neuron store's placement plan,
    the mode the plan was made for (runtime/plan.py plan_mode, which asks this function: "screen" reserved the MLP
    screens); with int8 weights and every neuron resident, "oracle" for tied neuron halves (computed a pair at a time,
    exact); else "sparse"."""
    sparsity = sparsity or {}
    if sparsity.get("activation") not in SCREENED or device or predictors:
        return "sparse"
    if plan is not None:
        return plan.get("mode", "sparse")
    if screen_applies(sparsity.get("activation"), weight_dtype):
        return "screen"
    return "oracle" if sparsity.get("tied_halves") else "sparse"


def _check_plan_mode(plan: dict | None, mode: str) -> None:
    """A neuron store's plan reserves the predictors (sparse) or the MLP screens (screen): the engine's mode must be its."""
    planned = (plan or {}).get("mode", "sparse")
    if plan is not None and mode in ("sparse", "screen") and mode != planned:
        raise SparseforgeError(f"the placement plan for {plan['fast_memory']} was made for the {planned} mode, the engine runs {mode}; load "
                               f"with mode {planned!r} or 'auto', or make the plan with --mode {mode}")  # fmt: skip


def _load_config(ckpt: Path):
    from sparseforge.checkpoint import check_tokenizer, check_weights, load_config

    path = ckpt / "config.json"
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass a sparse checkpoint directory (sparseforge convert)")
    config = load_config(ckpt)
    if any((ckpt / n).is_file() for n in ("model.safetensors.index.json", "model.safetensors")):  # else WeightReader says so
        check_weights(ckpt, config)
    check_tokenizer(ckpt)
    if getattr(config, "mlp_bias", False):
        raise SparseforgeError(f"{ckpt} has MLP biases (mlp_bias=true); the sparse engine supports bias-free MLPs only")
    return config


def _load_predictors(ckpt: Path, config, dtype: str, plan: dict | None) -> dict:
    from sparseforge.predictors.store import require_predictors

    require_predictors(ckpt, 'load with mode "screen", "oracle" or "dense"')
    predictors = load_unit_predictors(ckpt, dtype)
    for (layer, expert), p in predictors.items():
        shape = None if p is None else (p.fc1[0].shape[1], p.fc2t[0].shape[1] * (2 if p.pairs else 1))  # (H, I)
        if p is not None and shape != (config.hidden_size, config.intermediate_size):
            raise damaged(ckpt / "predictors.safetensors", f"holds a predictor for layer {layer} expert {expert} of a model with "
                          f"(hidden, intermediate) = {shape}, config.json says {(config.hidden_size, config.intermediate_size)}")
    need = predictors_nbytes(predictors)
    if plan is not None and need > plan["always_touched"]["predictors"]:
        raise SparseforgeError(
            f"the plan reserves {plan['always_touched']['predictors']} B for predictors ({plan.get('predictor_dtype', 'float32')}), "
            f"the engine's {dtype} predictors take {need} B; make the plan with --predictor-dtype {dtype} "
            "(or load the engine with the plan's predictor dtype)"
        )
    return predictors


def _head_screen(weights: ModelWeights, plan: dict | None, threads: int, native: bool, wanted: bool | None) -> HeadScreen | None:
    """The lm_head's screen: None when not wanted or not possible; an error when wanted (True) and not possible."""
    if wanted is False:
        return None
    head = weights.lm_head
    why = None
    if not native:
        why = "the native kernels are off"
    elif head.weight.dtype not in FLOAT_DTYPES or head.bias is not None:
        why = f"the lm_head is {str(head.weight.dtype).removeprefix('torch.')}{' with a bias' if head.bias is not None else ''} (a screen needs a float head without bias)"
    need = screen_bytes(*head.weight.shape)
    if why is None and plan is not None and plan["always_touched"].get("head_screen", 0) < need:
        why = f"the placement plan reserves {plan['always_touched'].get('head_screen', 0)} B for it, not {need} B (make the plan again)"
    if why is not None:
        if wanted:
            raise SparseforgeError(f"head_screen=True but {why}; load with head_screen=None or False")
        return None
    return HeadScreen(head.weight, threads)
