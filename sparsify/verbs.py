"""The sparsify stage's verbs as typed functions: `convert`, `measure`, `threshold`. `cli.py` parses the options
into them; `sparseforge run` calls them. Each prints what it did and returns what it wrote."""

import time
from pathlib import Path

from sparseforge.data import TextStream
from sparseforge.errors import SparseforgeError


def convert(model: str, out: str, activation: str = "drelu", threshold: str | None = None, dtype: str = "auto",
            force: bool = False, halves: bool = False) -> Path:
    """Convert a dense SwiGLU model into a sparse checkpoint at `out`. threshold: for shifted_relu/fatrelu, one number
    or one per layer, comma-separated (sparsify.convert.parse_thresholds). halves: dReLU neuron halves (twice the MLP
    width, sparsify.convert.split_halves)."""
    from sparseforge.checkpoint import check_output, save_sparse
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import check_halves, convert_model, model_card, parse_thresholds
    from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS

    start = time.perf_counter()
    if activation not in ACTIVATIONS:  # before the (slow) model load
        raise SparseforgeError(f"unknown --activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if halves:
        check_halves(activation)
    check_output(out, force)
    dense, tokenizer, source = load_model(model, dtype=dtype)
    thresholds = parse_thresholds(threshold, activation, dense.config.num_hidden_layers)
    sparse = convert_model(dense, activation, thresholds, source=model, halves=halves)
    save_sparse(sparse, tokenizer, out, force=force, card=model_card(model, sparse.config))
    params = sum(p.numel() for p in sparse.parameters())
    print(
        f"wrote {out}: {sparse.config.sparsity['base_model_type']} with {activation} MLPs{' (neuron halves)' if halves else ''}, "
        f"{sparse.config.num_hidden_layers} layers, {params / 1e6:.1f}M parameters, from {source.describe()} "
        f"in {time.perf_counter() - start:.0f}s"
    )
    return Path(out)


def measure(model: str, stream: TextStream = TextStream(), activation: str | None = None, threshold: str | None = None) -> dict:
    """Fraction of exactly-zero MLP activations per layer over `stream`; written to MODEL/sparsity.json when `model` is a
    sparse checkpoint (a dense model is converted in memory to `activation`, default silu, and nothing is written)."""
    from sparseforge.checkpoint import write_artifact
    from sparseforge.families import is_sparse
    from sparseforge.sources import load_for_stream
    from sparseforge.sparsify.convert import convert_model, parse_thresholds
    from sparseforge.sparsify.measure import SPARSITY_FILE_VERSION, format_table, measure_sparsity

    net, tokenizer, source = load_for_stream(model, stream)
    sparse_ckpt = is_sparse(net.config)
    if sparse_ckpt and (activation or threshold):
        raise SparseforgeError(f"{model} is already a sparse checkpoint ({net.config.sparsity['activation']}); drop --activation/--threshold")
    if not sparse_ckpt:
        activation = activation or "silu"
        net = convert_model(net, activation, parse_thresholds(threshold, activation, net.config.num_hidden_layers))
    report = measure_sparsity(net, stream.windows(tokenizer), stream.tokens, stream.batch_size, progress=stream.progress)
    if report["tokens"] < stream.tokens:
        print(f"note: the data held only {report['tokens']} tokens (asked for {stream.tokens})")
    print(f"{source.describe()} ({net.config.sparsity['activation']}), data: {' '.join(stream.patterns)}")
    print(format_table(report))
    if sparse_ckpt:
        record = {"activation": net.config.sparsity["activation"], "data": stream.patterns, "seq_len": stream.seq_len, **report}
        print(f"wrote {write_artifact(source.path, 'sparsity', record, SPARSITY_FILE_VERSION)}")
    return report


def threshold(ckpt: str, out: str, target_zeros: float, stream: TextStream = TextStream(), force: bool = False,
              criterion: str = "product", allocation: str = "uniform") -> dict:
    """Calibrate per-layer dReLU thresholds for `target_zeros` exact zeros over `stream` (criterion and allocation:
    sparsify.threshold); write the thresholded checkpoint to `out` (its calibration in OUT/thresholds.json). Returns
    the calibration report."""
    from sparseforge.checkpoint import carry_source, check_output, save_sparse, write_artifact
    from sparseforge.sources import load_for_stream
    from sparseforge.sparsify.convert import model_card
    from sparseforge.sparsify.threshold import THRESHOLDS_FILE_VERSION, apply_thresholds, calibrate_thresholds, check_rule, check_target_zeros, format_table

    check_target_zeros(target_zeros)  # before the (slow) model load
    check_rule(criterion, allocation)
    check_output(out, force)
    if Path(out).resolve() == Path(ckpt).resolve():
        raise SparseforgeError(f"--out {out!r} is the input checkpoint; write the thresholded model to a new directory")
    start = time.perf_counter()
    model, tokenizer, _ = load_for_stream(ckpt, stream, sparse_for="`sparseforge threshold`")
    report = calibrate_thresholds(model, stream.windows(tokenizer), stream.tokens, target_zeros, stream.batch_size, stream.progress,
                                  criterion, allocation)
    apply_thresholds(model, report["thresholds"])
    original = carry_source(model.config, ckpt)  # eval's "original" row stays the dense model
    save_sparse(model, tokenizer, out, force=force, card=model_card(original, model.config) if original else None)
    write_artifact(out, "thresholds", {"source": ckpt, "data": stream.patterns, "seq_len": stream.seq_len, **report}, THRESHOLDS_FILE_VERSION)
    print(format_table(report))
    print(f"wrote {out} ({report['tokens']} tokens, {time.perf_counter() - start:.0f}s); next: `sparseforge measure {out}` for the real "
          "sparsity and loss, then continue pretraining it (docs/training.md) before profiling")
    return report
