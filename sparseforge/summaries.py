"""One-line summaries of what each pipeline stage wrote into a checkpoint, for `sparseforge run`'s table ("" when
the stage's artifact is not there)."""

from pathlib import Path

from sparseforge.files import read_json


def _json(ckpt: Path, name: str) -> dict:
    path = ckpt / name
    return read_json(path) if path.is_file() else {}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def measure(ckpt: Path) -> str:
    s = _json(ckpt, "sparsity.json")
    return f"MLP zeros {_pct(s.get('mean_zero_fraction'))}, loss {s.get('loss', float('nan')):.3f}" if s else ""


def profile(ckpt: Path) -> str:
    p = _json(ckpt, "profile.json")
    return f"{p.get('tokens', '?')} tokens profiled" if p else ""


def predictors(ckpt: Path) -> str:
    p = _json(ckpt, "predictors.json")
    h = p.get("heldout", {})
    if not h:
        return ""
    return (f"recall {h.get('recall', float('nan')):.3f}, predicted active {_pct(h.get('predicted_fraction'))} "
            f"vs true {_pct(h.get('true_fraction'))}, {_pct(p.get('params_fraction'))} of MLP params")


def predictors_calibrate(ckpt: Path) -> str:
    p = _json(ckpt, "predictors.json")
    c = p.get("curve")
    if not c:
        return f"recall target {p['target_recall']:g}" if p else ""
    point = next(q for q in c["points"] if q["target_recall"] == c["knee"])
    return (f"knee at recall {c['knee']:g}: predicted active {_pct(point['fresh']['predicted_fraction'])} on fresh text, "
            f"ppl {100 * point['ppl_increase']:+.2f}% vs exact mask")


def predictors_eval(ckpt: Path) -> str:
    e = _json(ckpt, "predictors.json").get("eval", {})
    if not e:
        return ""
    return (f"ppl dense {e['dense']['perplexity']:.3f} / oracle {e['oracle']['perplexity']:.3f} / predicted "
            f"{e['predicted']['perplexity']:.3f} ({100 * e['predicted_vs_oracle_ppl']:+.2f}%)")


def plan(ckpt: Path) -> str:
    parts = []
    for path in sorted(ckpt.glob("plan*.json")):
        plan = read_json(path)
        parts.append(f"{plan.get('fast_memory')}: hit {_pct(plan.get('expected_hit_rate'))}")
    return ", ".join(parts)


def accuracy(ckpt: Path) -> str:
    values = _json(ckpt, "eval.json").get("average", {}).get("values", {})
    return "mean accuracy " + ", ".join(f"{name} {v:.3f}" for name, v in values.items()) if values else ""


def scorecard(ckpt: Path) -> str:
    modes = _json(ckpt, "scorecard.json").get("speed", {}).get("modes", {})
    parts = [f"{m} {d['decode_tokens_per_second']:.1f} tok/s" for m, d in modes.items()]
    speedup = modes.get("sparse", {}).get("decode_speedup_vs_dense")
    return "decode " + ", ".join(parts) + (f" (sparse {speedup:.2f}x dense)" if speedup else "") if parts else ""
