"""benchmarks/decode.py: the PowerInfer rows (reading PowerInfer's own log lines, checking --powerinfer/--powerinfer-gguf
up front, and, when POWERINFER_BIN and POWERINFER_F16_GGUF name a real build and GGUF, one real run of the binary), the
bytes bound, and the int8 block's llama.cpp rows."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts import BENCHMARKS, load_script
from tiny import profiled_checkpoint

from sparseforge.errors import SparseforgeError


# stderr lines of PowerInfer's main (commit d3ebd7c5) on an F16 GGUF of the dReLU SmolLM2-135M, -n 16
LOG = """llm_load_print_meta: model ftype      = mostly F16
llm_load_print_meta: sparse_pred_threshold = -3.69
llm_load_sparse_model_tensors: mem required  =  325.93 MB
llama_print_timings:        load time =      83.76 ms
llama_print_timings:      sample time =       1.23 ms /    16 runs   (    0.08 ms per token, 12997.56 tokens per second)
llama_print_timings: prompt eval time =      87.39 ms /     5 tokens (   17.48 ms per token,    57.21 tokens per second)
llama_print_timings:        eval time =     557.32 ms /    15 runs   (   37.15 ms per token,    26.91 tokens per second)
llama_print_timings:       total time =     659.54 ms
"""



@pytest.fixture(scope="module")
def decode():
    return load_script("decode")


def test_parse_powerinfer_log(decode):
    log = decode.parse_powerinfer_log(LOG)
    assert log["ftype"] == "mostly F16"
    assert log["weight_bytes"] == pytest.approx(325.93 * 2**20)
    assert log["prompt eval"] == (pytest.approx(0.08739), 5)
    assert log["eval"] == (pytest.approx(0.55732), 15)
    assert 15 / log["eval"][0] == pytest.approx(26.91, abs=0.01)  # its own tokens-per-second figure
    assert "eval" not in decode.parse_powerinfer_log(LOG.replace("       eval time", "  other time"))


def args(binary=None, ggufs=()):
    return argparse.Namespace(powerinfer=binary, powerinfer_gguf=list(ggufs))


def test_powerinfer_options_checked_up_front(decode, tmp_path):
    binary, gguf, plain = tmp_path / "main", tmp_path / "m.gguf", tmp_path / "llama.gguf"
    binary.write_bytes(b"")
    gguf.write_bytes(b"PWRI" + bytes(12))
    plain.write_bytes(b"GGUF" + bytes(12))
    assert decode.powerinfer_ggufs(args()) == []
    assert decode.powerinfer_ggufs(args(binary, [f"F16={gguf}", f"Q4_0={gguf}"])) == [("F16", gguf), ("Q4_0", gguf)]
    bad = {
        "--powerinfer-gguf needs --powerinfer": args(None, [f"F16={gguf}"]),
        "no such file; build": args(tmp_path / "nope", [f"F16={gguf}"]),
        "--powerinfer needs --powerinfer-gguf": args(binary),
        "LABEL one of": args(binary, [f"BF16={gguf}"]),
        "give LABEL=PATH": args(binary, [str(gguf)]),
        "no such file; convert": args(binary, [f"F16={tmp_path / 'none.gguf'}"]),
        "not a PowerInfer GGUF": args(binary, [f"F16={plain}"]),
    }
    for message, a in bad.items():
        with pytest.raises(SparseforgeError, match=message):
            decode.powerinfer_ggufs(a)


@pytest.mark.skipif(not (os.environ.get("POWERINFER_BIN") and os.environ.get("POWERINFER_F16_GGUF")),
                    reason="set POWERINFER_BIN and POWERINFER_F16_GGUF (docs/benchmarks.md, PowerInfer side by side)")  # fmt: skip
def test_powerinfer_real_run(decode):
    binary, gguf = Path(os.environ["POWERINFER_BIN"]), Path(os.environ["POWERINFER_F16_GGUF"])
    engine = decode.PowerInfer(binary, gguf, "F16", "The capital of France is", context=64, threads=1)
    prefill_s, decode_tps, n = engine.run([0] * 5, 4)
    assert engine.prompt_tokens == 5 and n == 4  # SmolLM2's BPE: 5 tokens, as sparseforge's tokenizer gives
    assert prefill_s > 0 and decode_tps > 0 and engine.weight_bytes > 0
    with pytest.raises(SparseforgeError, match="loads it as 'mostly F16'"):
        decode.PowerInfer(binary, gguf, "Q4_0", "Hi", context=64, threads=1).run([0], 2)


def test_bytes_bound_per_precision(decode, tmp_path):
    """The bound is the dense step's bytes over those of a step reading only the fired neurons' rows, taken per
    precision from that precision's own dense engine (the engines share names across precisions)."""
    from tiny import tiny_model, tiny_tokenizer

    from sparseforge.checkpoint import save_sparse
    from sparseforge.runtime.engine import Engine
    from sparseforge.sparsify.convert import convert_model

    model = convert_model(tiny_model("llama"), "drelu")
    save_sparse(model, tiny_tokenizer(), tmp_path / "ckpt")
    c = model.config
    contestants, rows = [], []
    for prec, dtype, elem in (("fp32", "float32", 4), ("fp16", "float16", 2)):
        for mode in ("dense", "screen"):
            engine = Engine.load(tmp_path / "ckpt", mode=mode, weight_dtype=dtype, progress=False)
            mlp = decode.mlp_bytes(engine.model)
            assert mlp == c.num_hidden_layers * 3 * c.intermediate_size * c.hidden_size * elem
            contestants.append((prec, argparse.Namespace(name=f"sparseforge {mode}", mlp_bytes=mlp)))
            rows.append({"precision": prec, "engine": f"sparseforge {mode}", "mode": mode, "full_head": True, "neurons_fired": 0.25,
                         "bytes_per_token": 2 * mlp if mode == "dense" else mlp, "decode_tps": 10.0 if mode == "dense" else 15.0})
    notes = decode.bytes_bound(rows, contestants)
    assert len(notes) == 2 and all("bytes bound 1.60x" in n for n in notes)  # 2m / (2m - 0.75 m)
    for row in rows:
        assert row["bytes_bound"] == pytest.approx(1.6)
        assert row["of_bound"] == pytest.approx((1.5 if row["mode"] == "screen" else 1.0) / 1.6)

    # a reference row (--reference: e.g. the original's width beside a neuron-halves checkpoint) reads 1.5 m densely
    for prec in ("fp32", "fp16"):
        mlp = next(c.mlp_bytes for p, c in contestants if p == prec)
        rows.append({"precision": prec, "engine": "sparseforge dense, x (reference)", "mode": "reference", "full_head": True,
                     "neurons_fired": 0.25, "bytes_per_token": 1.5 * mlp, "mb_per_token": 1.5 * mlp / 1e6, "decode_tps": 12.0})
    notes = decode.bytes_bound(rows, contestants)
    assert len(notes) == 4 and sum("bytes bound 1.20x the reference" in n for n in notes) == 2  # 1.5m / 1.25m
    assert all("bytes_bound" not in r for r in rows if r["mode"] == "reference")


def test_the_int8_block_runs_llama_cpp_q4_0_of_the_checkpoint_and_the_original_q4_1(decode, tmp_path, monkeypatch):
    """Each llama.cpp row of the int8 block is counted by its GGUF's own tensor bytes (plus an F16 KV cache)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from tiny import profiled_checkpoint

    ckpt = profiled_checkpoint(tmp_path, "llama")[0]
    export = load_script("gguf_export")
    q4_0 = export.export_gguf(ckpt, tmp_path / "q4_0.gguf", "Q4_0")
    monkeypatch.setattr(decode, "cached_gguf", lambda c, work, t: q4_0 if (c, t) == (ckpt, "Q4_0") else pytest.fail(t))
    monkeypatch.setattr(decode, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(decode, "LlamaCppPython", lambda path, label, context, threads, bpt: (path, label, bpt))
    args = argparse.Namespace(work_dir=tmp_path, llama_bench=None, threads=1, reference=None)
    rows = [decode.llama_cpp_contestant(args, ckpt, t, 8, 32, []) for t in decode.PRECISIONS["int8"][2]]
    kv = decode.kv_bytes(ckpt, 8, 2)
    tensor_bytes = [sum(int(t.n_bytes) for t in gguf.GGUFReader(p).tensors) for p in (q4_0, export.original_smollm2_gguf())]
    assert rows == [(q4_0, "Q4_0 (checkpoint weights)", tensor_bytes[0] + kv),
                    (export.original_smollm2_gguf(), "Q4_1 (original SmolLM2 file)", tensor_bytes[1] + kv)]  # fmt: skip
    args.reference = str(ckpt)  # --reference: llama.cpp runs the reference's weights (here the same checkpoint)
    monkeypatch.setattr(decode, "cached_gguf", lambda c, work, t: q4_0 if (Path(c), t) == (ckpt, "Q4_0") else pytest.fail(t))
    assert decode.llama_cpp_contestant(args, tmp_path / "other", "Q4_0", 8, 32, [])[1] == "Q4_0 (reference weights)"


def test_also_engines_are_checked_up_front(decode, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert decode.also_engines([f"{tmp_path}/ckpt:screen", f"{tmp_path}/ckpt:dense"]) == [(tmp_path / "ckpt", "screen"), (tmp_path / "ckpt", "dense")]
    with pytest.raises(SparseforgeError, match="give CKPT:MODE with MODE one of sparse, oracle, screen, dense"):
        decode.also_engines([f"{tmp_path}/ckpt"])
    with pytest.raises(SparseforgeError, match="is not a checkpoint directory"):
        decode.also_engines([f"{tmp_path}/missing:screen"])


def test_a_run_probes_the_read_bandwidth_after_each_repetition(tmp_path):
    """A whole run on a tiny checkpoint: every row timed in each repetition, the bandwidth probed after each."""
    ckpt = profiled_checkpoint(tmp_path, "llama")[0]
    out = tmp_path / "res" / "dec"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "decode.py"), "--ckpt", str(ckpt), "--modes", "oracle", "dense", "--precisions", "fp32",
                           "--no-hf", "--no-llama-cpp", "--reps", "2", "--new-tokens", "3", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["bandwidth_reps"]) == 2 and all(b > 0 for b in data["bandwidth_reps"])
    assert [len(r["decode_all"]) for r in data["rows"]] == [2, 2]
    assert "after each repetition" in out.with_suffix(".md").read_text()
