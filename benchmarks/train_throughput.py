"""Training throughput of a recipe's end-to-end step on this device: tokens/s and model-FLOPs utilization.

Runs the real training loop (`sparseforge.train.loop.train`, teacher included when the recipe distills) for
`--warmup + --steps` optimizer steps with one metric line per step, and reports the median step time over the
steps after the warm-up (the first steps pay for compilation, allocator growth and the token store). Stage 1 is
skipped (layerwise_tokens=0): it is timed by its own log line in a real run.

Model FLOPs per token (PaLM's accounting, no recomputation counted): the student's forward 2N + 4·L·d·S, its
backward 2N + 8·L·d·S for activation gradients plus 2·N_trainable for weight gradients, and the teacher's forward
2N_teacher + 4·L·d·S, where N counts every weight a token is multiplied by (the LM head included, the embedding
lookup not; with tied neuron halves one gate and one up row per pair; the teacher at its own, dense width), L layers,
d the attention width, S the sequence length. MFU divides achieved FLOP/s by the device's peak: the datasheet dense
figure for known GPUs at the step's precision, and on a CPU the matmul rate measured here at the step's precision
(float32, or bf16 under bf16 autocast; so "MFU" there is the fraction of what this CPU's matmul reaches).

    python benchmarks/train_throughput.py --config recipes/smollm2-135m-drelu.yaml --steps 6 --warmup 2
    python benchmarks/train_throughput.py --config recipes/smollm2-135m-drelu-gpu.yaml --set micro_batch_size=32 --steps 20

`--stage1` times the recipe's stage 1 instead (layer-wise distillation on its `layerwise_tokens`, then its
thresholds; no end-to-end step): seconds, whether its MLP work multiplied in bf16 (train/precision.py), the mean
relative error of its layers and the validation loss after it, so that two precisions compare on speed and quality.

    python benchmarks/train_throughput.py --config recipes/smollm2-135m-quickstart.yaml --stage1 --set mixed_precision=no

Writes benchmarks/results/train-throughput-<device>.json (+ .md; --stage1: stage1-throughput-<device>). Tests never
assert timings.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, results_path, write_results  # noqa: E402

# dense tensor-core peaks (FLOP/s) from NVIDIA's datasheets, by device-name fragment and precision
GPU_PEAKS = {
    "H100 SXM": {"bf16": 989.4e12, "fp16": 989.4e12, "no": 494.7e12},
    "H100 80GB HBM3": {"bf16": 989.4e12, "fp16": 989.4e12, "no": 494.7e12},
    "H100 PCIe": {"bf16": 756.0e12, "fp16": 756.0e12, "no": 378.0e12},
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "no": 494.7e12},
    "A100": {"bf16": 312.0e12, "fp16": 312.0e12, "no": 156.0e12},
}


def flops_per_token(config, trainable_params: int, seq_len: int, teacher: bool, tied: bool = False) -> dict:
    """Model FLOPs per trained token (see the module docstring). A model with neuron halves (config.sparsity) has
    twice its dense teacher's MLP width; tied halves compute only the first half's gate and up rows (train/tied.py),
    so the other half's rows count in neither N nor the weight gradients."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    attn_width = config.num_attention_heads * head_dim
    width = config.intermediate_size
    halves = bool((getattr(config, "sparsity", None) or {}).get("halves"))
    rows = width // 2 if tied else width  # gate and up rows a token is multiplied by
    attn = d * attn_width * 2 + d * kv * 2  # q, o, k, v
    n = layers * (attn + 2 * d * rows + d * width) + vocab * d  # + gate, up, down and the LM head
    n_teacher = layers * (attn + 3 * d * (width // 2 if halves else width)) + vocab * d
    attention = 4 * layers * attn_width * seq_len  # scores and weighted sum, forward
    computed = trainable_params - layers * 2 * d * (width - rows)  # weight gradients computed (tied: one row of each pair)
    student = 2 * n + attention + (2 * n + 2 * attention) + 2 * computed
    teacher_flops = 2 * n_teacher + attention if teacher else 0
    return {"matmul_params": n, "student": student, "teacher": teacher_flops, "total": student + teacher_flops}


def cpu_peak(threads: int, dtype: torch.dtype = torch.float32) -> float:
    """matmul FLOP/s on this CPU in `dtype` (2048^3, median of 5)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / statistics.median(times)


def peak(device: torch.device, precision: str, threads: int) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks[precision], f"{name} datasheet dense {precision}"
        return float("nan"), f"{name}: no datasheet peak known"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return cpu_peak(threads, dtype), f"measured {str(dtype).removeprefix('torch.')} matmul, {threads} threads"


def main(argv=None) -> int:
    from sparseforge.cli_options import add_recipe_options
    from sparseforge.train.loop import train
    from sparseforge.atomic import atomic_write_text
    from sparseforge.train.metrics import read_metrics
    from sparseforge.train.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_recipe_options(p)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's choice)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default train-throughput-<device>; --profile adds OUT-profile.md)")
    p.add_argument("--stage1", action="store_true", help="time the recipe's stage 1 (and its thresholds) instead of its steps")
    p.add_argument("--profile", action="store_true", help="also run torch.profiler over the whole run and write the ops that take "
                   "the device's time to <out>-profile.md (slows the steps: time without it)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(torch.get_num_threads())
    if args.stage1:
        return stage1(args, argv, env)
    with tempfile.TemporaryDirectory() as tmp:
        fixed = [f"output_dir={tmp}/run", f"max_steps={args.warmup + args.steps}", "warmup_steps=0", "layerwise_tokens=0",
                 "log_every=1", "eval_every=0", "save_every=0", "report_to=[]"]
        recipe = load_recipe(args.config, args.overrides + fixed)
        with profiler(args.profile) as prof:
            train(recipe, progress=False)
        lines = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
        start = next(line for line in lines if line.get("event") == "start")
        steps = [line for line in lines if "step_seconds" in line]
        from sparseforge.checkpoint import load_sparse

        model = load_sparse(Path(tmp) / "run" / "checkpoint")
    trainable = sum(p.numel() for n, p in model.named_parameters() if recipe.trainable == "all" or ".mlp." in n)
    tokens_per_step = recipe.micro_batch_size * start["num_processes"] * recipe.gradient_accumulation_steps * recipe.seq_len
    step_s = statistics.median(s["step_seconds"] for s in steps[args.warmup:])
    flops = flops_per_token(model.config, trainable, recipe.seq_len, recipe.distill_kl > 0, recipe.tied_halves)
    device = torch.device(start["device"])
    peak_flops, peak_source = peak(device, start["mixed_precision"], torch.get_num_threads())
    tokens_per_s = tokens_per_step / step_s
    result = {
        **_run(argv, env, start, recipe),
        "tokens_per_step": tokens_per_step,
        "step_seconds": [round(s["step_seconds"], 4) for s in steps],
        "median_step_seconds": step_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "peak_flops": peak_flops,
        "peak_source": peak_source,
        "mfu": tokens_per_s * flops["total"] / peak_flops,
        "final_loss": steps[-1]["loss"],
    }
    out = args.out or f"train-throughput-{device.type}"
    write_results(out, result, table(result))
    print(table(result))
    if prof is not None:
        atomic_write_text(f"{results_path(out)}-profile.md", profile_table(prof, result))
    return 0


def _run(argv, env: dict, start: dict, recipe) -> dict:
    """The command, the environment (with the run's device and precision from its start line) and the recipe."""
    return {
        "command": "python benchmarks/train_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": {**env, **{k: start[k] for k in ("device", "distributed_type", "num_processes", "mixed_precision")}},
        "recipe": {k: v for k, v in recipe.to_dict().items() if k not in ("stages", "output_dir")},
    }


def stage1(args, argv, env: dict) -> int:
    """--stage1: run the recipe up to the end of stage 1 and its thresholds, and write its record."""
    from sparseforge.train.loop import train
    from sparseforge.train.metrics import read_metrics
    from sparseforge.train.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(args.config, args.overrides + [f"output_dir={tmp}/run", "max_steps=0", "warmup_steps=0", "report_to=[]"])
        if not recipe.layerwise_tokens:
            raise SystemExit("train_throughput.py --stage1: the recipe has layerwise_tokens: 0 (no stage 1); set it, e.g. --set layerwise_tokens=32768")
        train(recipe, progress=False)
        start = next(line for line in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if line.get("event") == "start")
        record = json.loads((Path(tmp) / "run" / "layerwise.json").read_text())  # stage 1's record with its layers
    layers = record["layers"]
    result = {
        **_run(argv, env, start, recipe),
        "stage1_seconds": record["seconds"],
        "tokens": record["tokens"],
        "bf16_products": record["bf16_products"],
        "layer_seconds": [round(layer["seconds"], 3) for layer in layers],
        "rel_mse_after": [layer["rel_mse_after"] for layer in layers],
        "mean_rel_mse_after": statistics.mean(layer["rel_mse_after"] for layer in layers),
        "val_loss_before": record["val_loss_before"],
        "val_loss_after": record["val_loss_after"],
    }
    out = args.out or f"stage1-throughput-{torch.device(start['device']).type}"
    write_results(out, result, stage1_table(result))
    print(stage1_table(result))
    return 0


def stage1_table(r: dict) -> str:
    loss = "/".join(f"{v:.3f}" for v in r["val_loss_after"].values())
    return (
        "| device | precision | MLP products | layer-wise tokens | stage 1 s | val loss after (" + "/".join(r["val_loss_after"]) + ") | mean relative error |\n"
        "| --- | --- | --- | ---: | ---: | ---: | ---: |\n"
        f"| {r['environment'].get('gpu') or r['environment']['device']} | {r['environment']['mixed_precision']} | "
        f"{'bf16, float32 accumulation' if r['bf16_products'] else 'float32'} | {r['tokens']:,} | {r['stage1_seconds']:.1f} | {loss} | "
        f"{r['mean_rel_mse_after']:.5f} |"
    )


def profiler(enabled: bool):
    """torch.profiler over CPU (and CUDA when present) activity, or a no-op context yielding None."""
    from contextlib import nullcontext

    if not enabled:
        return nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return torch.profiler.profile(activities=activities)


def profile_table(prof, result: dict, rows: int = 30) -> str:
    """The ops with the most self time on the device (the CPU when there is no GPU), over the whole run: model loading,
    validation, warm-up and timed steps, with the run's total busy time."""
    events = prof.key_averages()
    on_gpu = result["environment"]["device"].startswith("cuda")
    self_time = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in events if self_time(e) > 0), key=self_time, reverse=True)
    total_us = sum(self_time(e) for e in events)
    lines = [f"{'Device' if on_gpu else 'CPU'} busy {total_us / 1e6:.2f} s over the whole run (loading, validation, warm-up and the "
             f"{len(result['step_seconds'])} logged steps; median step {result['median_step_seconds']:.3f} s).", "",
             "| op | calls | self time s | share |", "| --- | ---: | ---: | ---: |"]
    for e in events[:rows]:
        lines.append(f"| `{e.key[:80]}` | {e.count} | {self_time(e) / 1e6:.3f} | {self_time(e) / total_us:.1%} |")
    return "\n".join(lines) + f"\n\nCommand: `{result['command']}`\n"


def table(r: dict) -> str:
    rec = r["recipe"]
    return (
        "| device | precision | seq | tokens/step | teacher | trainable | step s (median) | tokens/s | MFU |\n"
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: |\n"
        f"| {r['environment'].get('gpu') or r['environment']['device']} | {r['environment']['mixed_precision']} | {rec['seq_len']} | "
        f"{r['tokens_per_step']} | {'yes' if rec['distill_kl'] > 0 else 'no'} | {rec['trainable']} | {r['median_step_seconds']:.3f} | "
        f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} |\n\n"
        f"MFU against {r['peak_source']} ({r['peak_flops'] / 1e12:.1f} TFLOP/s)."
    )


if __name__ == "__main__":
    sys.exit(main())
