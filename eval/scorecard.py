"""`sparseforge scorecard`: accuracy and speed of a sparse checkpoint side by side, plus sparsity and predictor
statistics, as CKPT/scorecard.json (format_version 1), a Markdown table, two PNG plots and the model card.

Speed is measured in one process, engine modes alternating in every repetition (DESIGN.md: ratios from one
run, medians): for each mode a prompt of `prompt_tokens` real text tokens is prefilled into a fresh cache,
then `decode_tokens` greedy single-token steps follow (Engine.generate's token loop). Per mode: median prefill and decode tokens/s, the
engine's own counters (bytes touched per decode token, fraction of neurons computed, resident weight bytes)
and the process's peak-RSS growth while that engine loaded. Accuracy comes from CKPT/eval.json
(`sparseforge eval`); the "original" row is paired with the dense mode's speed (same architecture, every
neuron; for a checkpoint with neuron halves, whose MLPs are twice the original's, the original model itself is timed in
the dense mode beside the others), "oracle" with oracle, "sparse" with sparse.
"""

import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sparseforge.atomic import atomic_path, atomic_write_text
from sparseforge.checkpoint import write_artifact
from sparseforge.data import pretrain_prompt
from sparseforge.errors import SparseforgeError

SCORECARD_FORMAT_VERSION = 1
ACCURACY_TO_MODE = {"original": "dense", "oracle": "oracle", "sparse": "sparse"}


def speed_mode(config: str, speed: dict) -> str | None:
    """The engine mode of a scorecard's `speed` (measure_speed's result) that runs accuracy configuration `config`: the
    exact mask (oracle) at its fastest, the screen, when that was timed (screen and oracle compute the same neurons'
    outputs; runtime/screen.py). The original: the dense mode, or the original model itself when that was timed (a
    checkpoint with neuron halves, whose dense mode reads twice the original's MLP rows); None when neither reads what
    the original reads."""
    timed = speed.get("modes", {})
    if config == "original" and "original" in timed:
        return "original"
    if config == "original" and not speed.get("dense_is_original", True):
        return None
    mode = "screen" if config == "oracle" and "screen" in timed else ACCURACY_TO_MODE.get(config)
    return mode if mode in timed else None


@dataclass(frozen=True)
class SpeedSettings:
    modes: tuple[str, ...] = ("dense", "sparse")
    prompt_tokens: int = 128
    decode_tokens: int = 32
    repeats: int = 3
    threads: int | None = 1
    context: int = 512
    device: str | None = None  # the hybrid tier's device (runtime/hybrid.py); None: the CPU engine
    device_memory: str | None = None  # its budget (default 100%)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _one_run(engine, ids: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy generation (runtime/generate.py, as `generate` runs it)
    from a fresh cache: the prompt, then `decode_tokens` one-token steps."""
    from sparseforge.runtime.sampling import GenerationConfig

    tokens = engine.generate(ids[0], GenerationConfig(max_new_tokens=decode_tokens + 1, stop_ids=()))
    start = time.perf_counter()
    next(tokens)
    prefilled = time.perf_counter()
    for _ in tokens:
        pass
    done = time.perf_counter()
    return ids.shape[1] / (prefilled - start), decode_tokens / (done - prefilled)


def measure_speed(ckpt: str | Path, settings: SpeedSettings, progress: bool = True, log=print) -> dict:
    """Side-by-side prefill/decode speed of the engine modes (module docstring); for a checkpoint with neuron halves,
    also of the original (`modes["original"]`: its SwiGLU MLPs in the dense mode)."""
    if settings.prompt_tokens + settings.decode_tokens > settings.context:
        raise SparseforgeError(f"--prompt-tokens + --decode-tokens ({settings.prompt_tokens + settings.decode_tokens}) exceed --context {settings.context}")
    if "sparse" in settings.modes:  # before any engine loads
        from sparseforge.predictors.store import require_predictors

        require_predictors(ckpt, "pass --modes without sparse (e.g. dense,screen)")
    with tempfile.TemporaryDirectory(prefix="sparseforge-original-") as tmp:
        return _measure(ckpt, settings, progress, log, Path(tmp))


def _original_checkpoint(ckpt: Path, out: Path, log) -> Path | None:
    """The dense original recorded by `ckpt` (checkpoint.recorded_source), converted with its own SwiGLU MLPs into `out`
    for the engine's dense mode; None (and why, logged) when it cannot be loaded here."""
    from sparseforge.checkpoint import recorded_source, save_sparse
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model

    try:
        source = recorded_source(ckpt)
        dense, tokenizer, _ = load_model(source)
    except (SparseforgeError, OSError) as e:
        log(f"the original is not timed (this checkpoint's dense mode reads twice its MLP rows): {e}")
        return None
    save_sparse(convert_model(dense, "silu", source=source), tokenizer, out)
    return out


def _measure(ckpt: str | Path, settings: SpeedSettings, progress: bool, log, tmp: Path) -> dict:
    from sparseforge.runtime.engine import Engine

    engines, load_rss = {}, {}
    for mode in settings.modes:
        before = _peak_rss_bytes()
        engines[mode] = Engine.load(ckpt, mode=mode, context=settings.context, threads=settings.threads, progress=progress,
                                    device=settings.device, device_memory=settings.device_memory)  # fmt: skip
        load_rss[mode] = _peak_rss_bytes() - before
    # the dense mode reads every weight the original reads, unless neuron halves doubled the MLPs: then the original
    # itself is timed beside the modes, in the dense mode
    halves = bool(engines[settings.modes[0]].config.sparsity.get("halves"))
    if halves and "dense" in settings.modes and (original := _original_checkpoint(Path(ckpt), tmp / "original", log)):
        before = _peak_rss_bytes()
        engines["original"] = Engine.load(original, mode="dense", context=settings.context, threads=settings.threads, progress=progress,
                                          device=settings.device, device_memory=settings.device_memory)  # fmt: skip
        load_rss["original"] = _peak_rss_bytes() - before
    ids = torch.tensor([pretrain_prompt(engines[settings.modes[0]].tokenizer, settings.prompt_tokens)])
    runs = {m: {"prefill": [], "decode": []} for m in engines}
    for rep in range(settings.repeats + 1):  # repetition 0 warms up (first-touch of weights, allocator) and is dropped
        order = tuple(engines) if rep % 2 == 0 else tuple(reversed(engines))
        for mode in order:
            engines[mode].reset_stats()
            prefill, decode = _one_run(engines[mode], ids, settings.decode_tokens)
            if rep:
                runs[mode]["prefill"].append(prefill)
                runs[mode]["decode"].append(decode)
        if rep:
            log(f"repetition {rep}/{settings.repeats}: " + ", ".join(f"{m} decode {runs[m]['decode'][-1]:.1f} tok/s" for m in engines))
    out = {"settings": asdict(settings), "peak_rss_bytes": _peak_rss_bytes(), "dense_is_original": not halves, "modes": {}}
    for mode, engine in engines.items():
        stats = engine.stats()
        out["modes"][mode] = {
            "prefill_tokens_per_second": statistics.median(runs[mode]["prefill"]),
            "decode_tokens_per_second": statistics.median(runs[mode]["decode"]),
            "prefill_runs": runs[mode]["prefill"],
            "decode_runs": runs[mode]["decode"],
            "load_peak_rss_growth_bytes": load_rss[mode],
            **{k: stats.get(k) for k in ("bytes_touched_per_decode_token", "resident_weight_bytes")},
            "neurons_computed_fraction": stats.get("decode_neurons_computed_fraction"),  # per decode token, as the table says
            "neurons_fired_fraction": stats.get("decode_neurons_fired_fraction"),
            "device": stats.get("device"),  # the hybrid tier's hot neurons and device bytes (None: the CPU engine)
        }
    if "dense" in out["modes"]:
        dense = out["modes"]["dense"]
        for m in out["modes"].values():
            m["decode_speedup_vs_dense"] = m["decode_tokens_per_second"] / dense["decode_tokens_per_second"]
            m["prefill_speedup_vs_dense"] = m["prefill_tokens_per_second"] / dense["prefill_tokens_per_second"]
    return out


def _read(ckpt: Path, name: str) -> dict | None:
    from sparseforge.checkpoint import read_artifact

    return read_artifact(ckpt, name, 1) if (ckpt / f"{name}.json").is_file() else None


def _strip(artifact: dict | None) -> dict | None:
    return None if artifact is None else {k: v for k, v in artifact.items() if k != "format_version"}


def points(scorecard: dict) -> list[dict]:
    """(configuration, average accuracy, decode tok/s) for every accuracy row whose engine mode was timed."""
    acc = (scorecard.get("accuracy") or {}).get("average", {}).get("values", {})
    modes = scorecard["speed"]["modes"]
    timed = {c: speed_mode(c, scorecard["speed"]) for c in ACCURACY_TO_MODE if c in acc}
    return [{"config": c, "mode": m, "accuracy": acc[c], "decode_tokens_per_second": modes[m]["decode_tokens_per_second"]} for c, m in timed.items() if m]


def _save_png(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plot(ckpt: Path, scorecard: dict) -> list[Path]:
    """scorecard_sparsity.png (per-layer zero fraction and predicted-active fraction) and
    scorecard_accuracy_speed.png (average accuracy vs decode tok/s per configuration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sparsity, predictors = scorecard.get("sparsity"), scorecard.get("predictors")
    if sparsity:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        layers = [r["layer"] for r in sparsity["layers"]]
        ax.bar(layers, [r["zero_fraction"] for r in sparsity["layers"]], label="activations exactly zero")
        if predictors and all(u.get("predicted_fraction") is not None for u in predictors["units"]):
            ax.plot(layers, [1 - u["predicted_fraction"] for u in predictors["units"]], "k.-", label="neurons skipped by predictors")
        ax.set(xlabel="layer", ylabel="fraction", ylim=(0, 1), title="Per-layer sparsity")
        ax.legend(loc="lower right")
        _save_png(fig, ckpt / "scorecard_sparsity.png")
        plt.close(fig)
        written.append(ckpt / "scorecard_sparsity.png")
    pts = points(scorecard)
    if pts:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for p in pts:
            ax.scatter(p["decode_tokens_per_second"], p["accuracy"])
            ax.annotate(f"{p['config']} ({p['mode']})", (p["decode_tokens_per_second"], p["accuracy"]), textcoords="offset points", xytext=(5, 5))
        ax.set(xlabel="decode tokens/s (median, 1 stream)", ylabel="average accuracy", title="Accuracy vs speed")
        _save_png(fig, ckpt / "scorecard_accuracy_speed.png")
        plt.close(fig)
        written.append(ckpt / "scorecard_accuracy_speed.png")
    return written


def speed_markdown(speed: dict) -> str:
    """| mode | prefill tok/s | decode tok/s | x dense | bytes/token | neurons computed | resident weights |"""
    lines = ["| engine mode | prefill tok/s | decode tok/s | decode vs dense | bytes touched / decode token | neurons computed | resident weight bytes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for mode, m in speed["modes"].items():
        frac = m.get("neurons_computed_fraction")
        bpt = m.get("bytes_touched_per_decode_token")
        lines.append(
            f"| {mode} | {m['prefill_tokens_per_second']:.1f} | {m['decode_tokens_per_second']:.1f} | "
            f"{m.get('decode_speedup_vs_dense', float('nan')):.2f}x | {'-' if bpt is None else f'{bpt / 1e6:.1f} MB'} | "
            f"{'-' if frac is None else f'{100 * frac:.1f} %'} | {m['resident_weight_bytes'] / 1e6:.1f} MB |"
        )
    s = speed["settings"]
    if "original" in speed["modes"]:
        lines.append("\noriginal: the dense original model (its SwiGLU MLPs) in the dense mode; this checkpoint's MLPs are neuron halves, twice as wide.")
    lines.append(f"\nPrompt {s['prompt_tokens']} tokens, {s['decode_tokens']} greedy decode steps, median of {s['repeats']} alternating "
                 f"repetitions, {s['threads']} thread(s); process peak RSS {speed['peak_rss_bytes'] / 1e9:.2f} GB.")  # fmt: skip
    return "\n".join(lines)


def markdown(scorecard: dict) -> str:
    from sparseforge.eval.report import markdown as accuracy_markdown

    parts = []
    if scorecard.get("accuracy"):
        parts += ["### Accuracy", accuracy_markdown(scorecard["accuracy"])]
    parts += ["### Speed", speed_markdown(scorecard["speed"])]
    if pts := points(scorecard):
        parts.append("\n".join(f"- {p['config']}: average accuracy {p['accuracy']:.4f} at {p['decode_tokens_per_second']:.1f} decode tok/s (engine mode {p['mode']})" for p in pts))
    return "\n\n".join(parts)


def make_scorecard(ckpt: str | Path, settings: SpeedSettings, progress: bool = True, log=print) -> dict:
    """Measure speed, gather the other artifacts, write scorecard.json, the plots and README.md."""
    from sparseforge.export.card import build_card

    ckpt = Path(ckpt)
    accuracy = _read(ckpt, "eval")
    if accuracy is None:
        log(f"no {ckpt}/eval.json: the scorecard has speed only (run `sparseforge eval {ckpt} --tasks ...` first)")
    predictors = _read(ckpt, "predictors")
    scorecard = {
        "accuracy": _strip(accuracy),
        "speed": measure_speed(ckpt, settings, progress, log),
        "sparsity": _strip(_read(ckpt, "sparsity")),
        "predictors": None if predictors is None else {
            "params_fraction": predictors.get("params_fraction"), "heldout": predictors.get("heldout"), "eval": predictors.get("eval"),
            "units": [{"layer": u["layer"], "expert": u["expert"], **(u.get("heldout") or {})} for u in predictors["units"]],
        },
    }  # fmt: skip
    scorecard["plots"] = [p.name for p in plot(ckpt, scorecard)]
    write_artifact(ckpt, "scorecard", scorecard, SCORECARD_FORMAT_VERSION)
    atomic_write_text(ckpt / "README.md", build_card(ckpt))
    return {"format_version": SCORECARD_FORMAT_VERSION, **scorecard}
