"""The headline table of a scored checkpoint: the original model, the dReLU model with exact masks and with predicted
masks, side by side (accuracy, perplexity, sparsity, speed), from the checkpoint's scorecard.json.

    sparseforge run recipes/smollm2-135m-quickstart.yaml                                  # writes the scorecard
    python benchmarks/scorecard_table.py runs/quickstart/checkpoint --out quickstart      # results/quickstart.{json,md}

Nothing is measured here: every cell is a value `sparseforge scorecard` (with `eval`, `measure` and `predictors eval`
before it) wrote into CKPT/scorecard.json, which the results JSON keeps whole. A cell the scorecard has no value for
prints as —: the original's perplexity and sparsity (the pipeline scores the original for accuracy only) and the
exact-mask speed unless the scorecard timed `screen` or `oracle` (`--modes dense,sparse,screen`; the screen when both).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, markdown_table, write_results  # noqa: E402

from sparseforge.eval.scorecard import speed_mode  # noqa: E402

COLUMNS = (("original", "original (dense)"), ("oracle", "dReLU, exact masks"), ("sparse", "dReLU, predicted masks"))


def rows(card: dict) -> list[dict]:
    """One dict per table row: `what`, then one formatted cell per column key of COLUMNS."""
    acc, pred, timed = card.get("accuracy") or {}, (card.get("predictors") or {}).get("eval") or {}, card.get("speed") or {}
    speed = timed.get("modes", {})
    modes = {k: m for k, _ in COLUMNS if (m := speed_mode(k, timed))}  # the original: the dense mode, or the original itself
    masks = {"oracle": "oracle", "sparse": "predicted"}
    out = []
    if acc.get("average"):
        tasks = ", ".join(m.split(":")[0] for m in acc["average"]["metrics"])
        out.append({"what": f"mean accuracy ({tasks}; {acc.get('limit')} documents each)",
                    **{k: f"{v:.3f}" for k, v in acc["average"]["values"].items()}})
    if pred:
        out.append({"what": f"perplexity, {pred['tokens']:,} held-out tokens of the pretraining mix",
                    **{k: f"{pred[m]['perplexity']:.2f}" for k, m in masks.items() if m in pred}})
        out.append({"what": "MLP activations zero (same tokens)", **{k: f"{pred[m]['mean_zero_fraction']:.1%}" for k, m in masks.items() if m in pred}})
    for key, label, fmt in (("neurons_computed_fraction", "MLP neurons computed per decode token", ".1%"),
                            ("decode_tokens_per_second", "decode tokens/s", ".1f"),
                            ("prefill_tokens_per_second", "prefill tokens/s", ".0f"),
                            ("bytes_touched_per_decode_token", "MB touched per decode token", None)):
        cells = {k: (f"{speed[m][key] / 1e6:.1f}" if fmt is None else format(speed[m][key], fmt)) for k, m in modes.items() if m in speed}
        if cells:
            out.append({"what": label, **cells})
    return out


def _original_note(speed: dict) -> str:
    if "original" in speed.get("modes", {}):
        return "the original's speed is the original model (SwiGLU MLPs) in the engine's dense mode, timed alongside (this checkpoint's MLPs are neuron halves, twice as wide)."
    if speed.get("dense_is_original", True):
        return "the original's speed is the engine's dense mode, which reads every weight the original reads."
    return "the original is not timed: this checkpoint's dense mode reads twice its MLP rows (neuron halves)."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", type=Path, help="a checkpoint with scorecard.json (sparseforge scorecard)")
    p.add_argument("--out", required=True, help=OUT_HELP)
    args = p.parse_args(argv)
    card = json.loads((args.ckpt / "scorecard.json").read_text())
    settings = (card.get("speed") or {}).get("settings", {})
    table = markdown_table(rows(card), [("what", "", "")] + [(k, h, "s") for k, h in COLUMNS])
    notes = (f"Speed: prompt {settings.get('prompt_tokens')} tokens, {settings.get('decode_tokens')} greedy decode steps, "
             f"median of {settings.get('repeats')} alternating repetitions, {settings.get('threads')} thread(s); "
             + _original_note(card.get("speed") or {}))
    data = {"command": "python " + " ".join(["benchmarks/scorecard_table.py", *(argv if argv is not None else sys.argv[1:])]),
            "environment": environment(settings.get("threads") or 1), "checkpoint": str(args.ckpt), "scorecard": card}
    write_results(args.out, data, table + "\n\n" + notes)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
