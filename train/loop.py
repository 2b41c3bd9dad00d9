"""The continued-pretraining loop on accelerate (single CPU/GPU, DDP, DeepSpeed ZeRO, FSDP: whatever
`accelerate launch` was configured with; nothing distributed is hand-written here).

Run directory (`output_dir`):
    recipe.yaml          the resolved recipe
    metrics.jsonl        one JSON line per logged step / validation / stage (main process)
    layerwise.json       per-layer stats of layer-wise distillation (when enabled)
    thresholds.json      per-layer dReLU thresholds set after stage 1 (when target_zeros is set)
    state/step-NNNNNN/   resumable state: accelerate's (model, optimizer, scheduler, RNG) + data.json
    checkpoint/          the result: a sparse checkpoint, same contract as `sparseforge convert`

A state is written under a temporary name and renamed when complete; its data.json, written last, lists the
size of every file in it, and --resume takes the newest state whose files all match (a state cut short by a
crash, a full disk or a half-finished deletion is skipped, never loaded).
"""

import copy
import json
import logging
import math
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

from sparseforge.atomic import fsync_tree
from sparseforge.checkpoint import atomic_write_text, carry_source, save_sparse, write_artifact
from sparseforge.errors import SparseforgeError
from sparseforge.files import read_json
from sparseforge.families import is_sparse
from sparseforge.sources import load_model
from sparseforge.sparsify.convert import convert_model, model_card
from sparseforge.sparsify.threshold import THRESHOLDS_FILE_VERSION
from sparseforge.train.hooks import ActivationHooks
from sparseforge.train.layerwise import LayerwiseSettings, distill_layerwise
from sparseforge.train.metrics import MetricsLog
from sparseforge.train.mixture import build_mixture, validation_windows
from sparseforge.train.objective import LayerTap, Objective, model_validation_loss, teacher_outputs, validation_loss
from sparseforge.train.precision import device_settings, resolve_mixed_precision, stage1_bf16_products
from sparseforge.train.recipe import Recipe
from sparseforge.train.schedules import lr_multiplier, ramp
from sparseforge.train.tokens import check_sources
from sparseforge.train.thresholds import set_thresholds
from sparseforge.train.tied import tie_halves, untied_layers


class _TiedHeadNote(logging.Filter):
    """Drops accelerate's note that a state save left out the lm_head of a model with tied embeddings: the head is the
    embedding matrix, and loading the state ties it again (the resume tests pin this)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Removed shared tensor" in message and "lm_head" in message and "embed" not in message)


logging.getLogger("accelerate.utils.other").addFilter(_TiedHeadNote())


def _models(r: Recipe):
    """(student sparse model, tokenizer, dense teacher or None)."""
    model, tokenizer, _ = load_model(r.model, dtype="float32")
    needs_teacher = r.distill_kl > 0 or r.distill_hidden > 0 or r.layerwise_tokens > 0 or any("generated" in s for s in r.sources.values())
    if is_sparse(model.config):
        if r.neuron_halves and not model.config.sparsity.get("halves"):
            raise SparseforgeError(f"neuron_halves: true, but {r.model} was converted without them; start from the dense model or set neuron_halves: false")
        carry_source(model.config, r.model)
        teacher = load_model(r.teacher, dtype="float32")[0] if needs_teacher and r.teacher else None
        if needs_teacher and teacher is None:
            raise SparseforgeError("distill_kl, distill_hidden, layerwise_tokens and generated sources need a dense teacher: set recipe key 'teacher' (model is already sparse)")
        return model, tokenizer, teacher
    teacher = load_model(r.teacher, dtype="float32")[0] if r.teacher else (copy.deepcopy(model) if needs_teacher else None)
    thresholds = [r.threshold] * model.config.num_hidden_layers if r.threshold is not None else None
    return convert_model(model, r.activation, thresholds, source=r.model, halves=r.neuron_halves), tokenizer, teacher


def _state_problem(state: Path) -> str | None:
    """Why `state` cannot be resumed from (None: it is complete): data.json missing or damaged, or a file it
    lists missing or of another size."""
    try:
        data = read_json(state / "data.json")
    except SparseforgeError as e:
        return str(e).split(";")[0]
    if not isinstance(data.get("step"), int) or "mixture" not in data:
        return "its data.json lacks the step or the data position"
    for name, size in data.get("files", {}).items():  # states of older versions list none
        path = state / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is {'missing' if not path.is_file() else f'{path.stat().st_size:,} bytes, not {size:,}'}"
    return None


def _latest_state(state_dir: Path) -> Path | None:
    """The newest complete state under `state_dir` (incomplete ones are reported and skipped)."""
    for state in sorted(state_dir.glob("step-*"), reverse=True):
        problem = _state_problem(state)
        if problem is None:
            return state
        print(f"sparseforge train: skipping incomplete state {state}: {problem}", file=sys.stderr)
    return None


def _remove(path: Path) -> None:
    """Delete a directory so that an interruption never leaves part of it under its own name."""
    doomed = path.parent / f".{path.name}.tmp-removed-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _save_state(accelerator, state_dir: Path, step: int, mixture, keep: int) -> None:
    """Write state/step-<step> (temporary name, data.json with every file's size last, rename); keep the newest
    `keep` states."""
    final = state_dir / f"step-{step:06d}"
    if final.is_dir() and _state_problem(final) is None:
        return  # resumed at this very step: the state on disk is this one
    tmp = state_dir / f".{final.name}.tmp-save"  # one name all processes agree on
    if accelerator.is_main_process:
        for stale in state_dir.glob(".*.tmp-*"):  # what an interrupted save or deletion left
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every process's files are in before the state is declared complete
    if accelerator.is_main_process:
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "data.json").write_text(json.dumps({"step": step, "mixture": mixture.state_dict(), "files": files}))
        fsync_tree(tmp)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)  # a state directory is complete or absent
        others = sorted(p for p in state_dir.glob("step-*") if p != final)  # newer ones are incomplete ones resume skipped
        for old in others[: max(0, len(others) + 1 - keep)]:
            _remove(old)
    accelerator.wait_for_everyone()


def _configure_deepspeed(accelerator, r: Recipe) -> None:
    """DeepSpeed takes batch size, accumulation and clipping from its own config: fill and cross-check them."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = r.micro_batch_size
    for key, ours, recipe_key in (("gradient_accumulation_steps", r.gradient_accumulation_steps, "gradient_accumulation_steps"),
                                  ("gradient_clipping", r.grad_clip, "grad_clip")):
        theirs = ds.get(key, "auto")
        if theirs != "auto" and float(theirs) != float(ours):
            raise SparseforgeError(f"accelerate DeepSpeed config has {key}: {theirs} but the recipe has {recipe_key}: {ours}; make them equal")


def _freeze(model, trainable: str) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all, or the MLPs' only (attention, norms and embeddings frozen)."""
    if trainable == "mlp":
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." in name)
    return [p for p in model.parameters() if p.requires_grad]


def _generated_sources(r: Recipe, teacher, data: dict) -> dict:
    """Token stores of the recipe's teacher-generated sources, prompted by its file/Hub sources."""
    from sparseforge.train.teacher_text import generate_store

    generated = {name: entry["generated"] for name, entry in r.sources.items() if "generated" in entry}
    if not generated:
        return {}
    real = {name: entry for name, entry in r.sources.items() if "generated" not in entry}
    prompts = build_mixture(real, seq_len=r.seq_len, seed=r.seed + 1, **data)
    return {name: generate_store(name, settings, teacher, data["tokenizer"], prompts, r.seq_len, r.seed, r.token_cache, data["progress"])
            for name, settings in generated.items()}


def _stage1_zeros(r: Recipe) -> float | None:
    """The zeros stage 1 sets each layer's threshold for (layerwise_thresholds), or None."""
    if not r.layerwise_thresholds:
        return None
    return r.target_zeros if r.layerwise_target_zeros is None else r.layerwise_target_zeros


def _stage1(r: Recipe, model, teacher, mixture, device, mixed_precision: str, progress: bool) -> dict:
    """Layer-wise MLP distillation on the first layerwise_tokens of the mixture; returns its record. mixed_precision:
    the accelerator's (resolved), which decides whether stage 1 multiplies in bf16 (train/precision.py)."""
    windows = torch.as_tensor(mixture.next_batch(-(-r.layerwise_tokens // r.seq_len)), device=device)  # [N, S]
    settings = LayerwiseSettings(r.layerwise_epochs, r.layerwise_lr, r.layerwise_batch_tokens, r.layerwise_inputs,
                                 r.layerwise_target, r.layerwise_init, r.micro_batch_size,
                                 _stage1_zeros(r), r.seed, r.layerwise_ridge, r.layerwise_weights,
                                 stage1_bf16_products(mixed_precision, device))
    start = time.perf_counter()
    stats = distill_layerwise(model, teacher, windows, settings, progress)
    return {"stage": "layerwise", "step": 0, "tokens": windows.numel(), "seconds": time.perf_counter() - start,
            "bf16_products": settings.bf16_products, "layers": stats}


def train(r: Recipe, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> Path | None:
    """Run a recipe; returns the path of the resulting sparse checkpoint.

    stop_after: save the state and return None after this many steps (an interruption on purpose, to
    run a long recipe in time-boxed pieces with --resume).
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, set_seed
    from tqdm.auto import tqdm

    run_dir = Path(r.output_dir)
    state_dir = run_dir / "state"
    latest = _latest_state(state_dir) if resume else None
    if resume and latest is None:
        raise SparseforgeError(f"--resume: no saved state under {state_dir}; start without --resume")
    if not resume and state_dir.exists() and any(state_dir.glob("step-*")):
        raise SparseforgeError(f"{run_dir} already holds a run; pass --resume to continue it or choose another output_dir")
    check_sources(r.sources, r.data_root)  # a missing data folder stops the run before any model loads
    device = PartialState(cpu=r.device == "cpu").device  # this process's, as the Accelerator takes it: bf16 support, stage 1
    accelerator = Accelerator(
        gradient_accumulation_steps=r.gradient_accumulation_steps,
        mixed_precision=resolve_mixed_precision(r.mixed_precision, device),
        log_with=r.report_to or None,
        project_dir=str(run_dir),
        cpu=r.device == "cpu",
    )
    _configure_deepspeed(accelerator, r)
    if r.tied_halves and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise SparseforgeError(f"tied_halves ties pairs through gradient hooks, which {accelerator.distributed_type.value} partitioning "
                               "bypasses; train on one device or with DDP, or set tied_halves: false")
    settings = device_settings(device, r.teacher_dtype)
    set_seed(r.seed)
    main = accelerator.is_main_process
    if main:
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(r.to_dict(), sort_keys=False))
    if r.report_to:
        accelerator.init_trackers("sparseforge", config=r.to_dict())
    resume_step = read_json(latest / "data.json")["step"] if latest else None
    log = MetricsLog(run_dir / "metrics.jsonl", main, resume_step)

    model, tokenizer, teacher = _models(r)
    if r.tied_halves:
        tie_halves(model)
    model.to(device)
    if teacher is not None:
        teacher.to(device).eval().requires_grad_(False)
    with accelerator.main_process_first():  # one process builds the token stores, the others read them
        data = dict(tokenizer=tokenizer, val_every=r.val_every, root=r.data_root, token_cache=r.token_cache, progress=progress and main)
        val = validation_windows(r.sources, seq_len=r.seq_len, val_tokens=r.val_tokens, **data)
        data["generated"] = _generated_sources(r, teacher, data)
        mixture = build_mixture(r.sources, seq_len=r.seq_len, seed=r.seed, **data)

    if teacher is not None and latest is None:  # where recovery should head: the dense original on the same text
        log.write({"step": 0, "reference": "dense teacher", "val_loss": model_validation_loss(teacher, val, device, r.micro_batch_size)})
    val_loss_now = None  # the student's validation loss, when stage 1 has just measured it
    stage1_thresholds = None  # stage 1's per-layer stats, when it set the target_zeros thresholds
    if r.layerwise_tokens and latest is None:  # a resumed state already holds the stage-1 weights
        before = model_validation_loss(model, val, device, r.micro_batch_size)
        record = _stage1(r, model, teacher, build_mixture(r.sources, seq_len=r.seq_len, seed=r.seed, **data), device,
                         accelerator.mixed_precision, progress and main)
        record.update(val_loss_before=before, val_loss_after=(val_loss_now := model_validation_loss(model, val, device, r.micro_batch_size)))
        log.write({k: v for k, v in record.items() if k != "layers"})
        if main:
            atomic_write_text(run_dir / "layerwise.json", json.dumps(record, indent=1) + "\n")
        stage1_thresholds = record["layers"] if r.target_zeros is not None and _stage1_zeros(r) == r.target_zeros else None  # else calibrated after it
    if r.target_zeros is not None:
        record = set_thresholds(r, model, run_dir, latest, build_mixture(r.sources, seq_len=r.seq_len, seed=r.seed, **data), main,
                                progress and main, layerwise=stage1_thresholds)
        if record is not None:
            log.write(record)
            val_loss_now = val_loss_now if stage1_thresholds else None  # thresholds set after stage 1 changed the model: measure again
    if r.distill_kl == 0 and r.distill_hidden == 0:
        teacher = None
    elif teacher is not None:
        teacher.to(settings["teacher_dtype"])

    if r.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if r.compile:
        model.model.compile()
    hooks = ActivationHooks(model, collect_l1=r.l1_coef > 0)
    params = _freeze(model, r.trainable)
    zero3 = accelerator.state.deepspeed_plugin is not None and accelerator.state.deepspeed_plugin.zero_stage == 3
    objective = Objective(model, r.lm_weight, r.distill_kl, r.distill_temperature, fused=not zero3, hidden_weight=r.distill_hidden)
    teacher_tap = LayerTap(teacher) if teacher is not None and r.distill_hidden else None
    optimizer = torch.optim.AdamW(params, lr=r.lr, betas=tuple(r.betas), weight_decay=r.weight_decay,
                                  **({"fused": True} if settings["fused_adamw"] else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, r.warmup_steps, r.max_steps, r.min_lr_ratio))
    objective, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)
    evaluate = lambda: validation_loss(lambda ids: objective(ids, evaluate=True), val, accelerator.device, r.micro_batch_size)  # noqa: E731

    log.write({"step": resume_step or 0, "event": "resume" if latest else "start", "distributed_type": accelerator.distributed_type.value,
               "num_processes": accelerator.num_processes, "device": str(accelerator.device), "mixed_precision": accelerator.mixed_precision})
    step = 0
    if latest is not None:
        accelerator.load_state(str(latest))
        mixture.load_state_dict(read_json(latest / "data.json")["mixture"])
        step = resume_step
        accelerator.print(f"resumed from {latest} at step {step}")
    else:
        log.write({"step": 0, "val_loss": val_loss_now or evaluate()})

    world, rank = accelerator.num_processes, accelerator.process_index
    tokens_per_step = r.micro_batch_size * world * r.gradient_accumulation_steps * r.seq_len
    pin = accelerator.device.type == "cuda"
    objective.train()
    bar = tqdm(total=r.max_steps, initial=step, desc="train", unit="step", disable=not (progress and main))
    started = time.perf_counter()
    sums_since_log = torch.zeros(4, device=accelerator.device)  # CE, KL, L1, feature loss summed over micro-steps: read at log steps only
    micro_since_log, logged_at, logged_step, paused = 0, time.perf_counter(), step, 0.0  # paused: validation and saves
    while step < r.max_steps:
        if stop_after is not None and step >= stop_after:
            _save_state(accelerator, state_dir, step, mixture, r.keep_states)
            accelerator.print(f"stopped after step {step} as asked; continue with --resume")
            return None
        hooks.alpha = ramp(step, r.swap_steps)
        l1_weight = r.l1_coef * ramp(step, r.l1_ramp_steps)
        for _ in range(r.gradient_accumulation_steps):
            batch = torch.from_numpy(mixture.next_batch(r.micro_batch_size * world)[rank * r.micro_batch_size : (rank + 1) * r.micro_batch_size])
            ids = (batch.pin_memory() if pin else batch).to(accelerator.device, non_blocking=True)  # [B, S]
            with accelerator.accumulate(objective):
                loss, ce, kl, feat = objective(ids, *(teacher_outputs(teacher, ids, teacher_tap) if teacher is not None else ()))
                l1 = hooks.pop_l1()
                if l1 is not None:
                    loss = loss + l1_weight * l1
                sums_since_log += torch.stack([ce, kl, l1.detach() if l1 is not None else torch.zeros_like(ce), feat]).float()
                accelerator.backward(loss)
                grad_norm = accelerator.clip_grad_norm_(objective.parameters(), r.grad_clip) if accelerator.sync_gradients and r.grad_clip > 0 else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            micro_since_log += 1
        step += 1
        bar.update(1)
        if step % r.log_every == 0 or step == r.max_steps:
            ce_mean, kl_mean, l1_mean, feat_mean = (sums_since_log / micro_since_log).tolist()  # the one host sync of a logged step
            step_seconds = (time.perf_counter() - logged_at - paused) / (step - logged_step)
            sums_since_log.zero_()
            micro_since_log = 0
            sparsity = hooks.pop_sparsity()
            record = {"step": step, "loss": ce_mean, "lr": scheduler.get_last_lr()[0], "tokens": step * tokens_per_step,
                      "tokens_per_s": (step - (resume_step or 0)) * tokens_per_step / (time.perf_counter() - started),
                      "step_seconds": step_seconds,
                      "mlp_zero_fraction": sum(sparsity) / len(sparsity), "mlp_zero_fraction_per_layer": [round(s, 4) for s in sparsity]}
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            record.update(({"distill_kl": kl_mean} if r.distill_kl else {}) | ({"distill_hidden": feat_mean} if r.distill_hidden else {}))
            if r.l1_coef > 0:
                record.update(l1=l1_mean, l1_weight=l1_weight)
            if r.swap_steps:
                record["swap_alpha"] = hooks.alpha
            log.write(record)
            if r.report_to:
                accelerator.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=step)
            bar.set_postfix(loss=f"{record['loss']:.3f}", zero=f"{record['mlp_zero_fraction']:.3f}")
            logged_at, logged_step, paused = time.perf_counter(), step, 0.0
        pause = time.perf_counter()
        if (r.eval_every and step % r.eval_every == 0) or step == r.max_steps:
            val_loss = evaluate()
            log.write({"step": step, "val_loss": val_loss, "val_ppl": {k: math.exp(v) for k, v in val_loss.items()}})
        if (r.save_every and step % r.save_every == 0) or step == r.max_steps:
            _save_state(accelerator, state_dir, step, mixture, r.keep_states)
        paused += time.perf_counter() - pause
    bar.close()
    hooks.remove()
    checkpoint = _write_checkpoint(accelerator, objective, tokenizer, r, run_dir, step * tokens_per_step)
    if main and not r.keep_final_state and state_dir.exists():  # the checkpoint is complete: the states are only disk now
        _remove(state_dir)
    accelerator.wait_for_everyone()
    return checkpoint


def _write_checkpoint(accelerator, objective, tokenizer, r: Recipe, run_dir: Path, trained_tokens: int) -> Path:
    checkpoint = run_dir / "checkpoint"
    state = accelerator.get_state_dict(objective)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(objective).model
        unwrapped.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
        sparsity = unwrapped.config.sparsity
        if sparsity.get("halves"):
            untied = untied_layers(unwrapped)
            if r.tied_halves and untied:
                raise SparseforgeError(f"tied_halves: layer(s) {untied[:5]} drifted apart in training (something bypassed the "
                                       "gradient hooks of train/tied.py); train on one device or with DDP, or set tied_halves: false")
            sparsity["tied_halves"] = not untied
        sparsity["trained_tokens"] = sparsity.get("trained_tokens", 0) + trained_tokens  # end to end
        sparsity["layerwise_tokens"] = sparsity.get("layerwise_tokens", 0) + r.layerwise_tokens
        source = sparsity.get("source")  # the dense original (convert records it; _models carries it from a sparse start)
        save_sparse(unwrapped, tokenizer, checkpoint, force=True, card=model_card(source, unwrapped.config) if source else None)
        if r.target_zeros is not None:  # how the thresholds were calibrated, as `sparseforge threshold` records it
            write_artifact(checkpoint, "thresholds", read_json(run_dir / "thresholds.json"), THRESHOLDS_FILE_VERSION)
    accelerator.wait_for_everyone()
    if r.report_to:
        accelerator.end_training()
    return checkpoint
