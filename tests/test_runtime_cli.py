"""`sparseforge generate` and `chat` on a tiny checkpoint with predictors: the text equals the engine's own tokens,
stop strings, the chat history and /reset, a disk-backed run, and one-line errors."""

import io
import json
import shutil
import sys

import pytest
import torch
from tiny import random_windows, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.profile import profile_model, save_profile
from sparseforge.predictors.store import save_predictors
from sparseforge.runtime.engine import Engine, GenerationConfig
from sparseforge.sparsify.convert import convert_model

pytestmark = pytest.mark.usefixtures("one_thread")
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
PROMPT = "The quick brown fox"


def engine_checkpoint(root, chat_template: bool = True):
    """A tiny dReLU Llama checkpoint with a profile and random rank-8 predictors (threshold 0: about half the
    neurons predicted active), and a chat template on its tokenizer."""
    ckpt = root / "sparse-llama"
    model = convert_model(tiny_model("llama"), "drelu")
    tokenizer = tiny_tokenizer()
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    save_sparse(model, tokenizer, ckpt)
    tensors, report = profile_model(model, random_windows(4, 32), tokens=128, batch_size=2, coact_tokens=16, block_size=8, progress=False)
    save_profile(ckpt, tensors, report)
    torch.manual_seed(1)
    H, I = model.config.hidden_size, model.config.intermediate_size
    fitted = [FittedUnit(i, 0, LowRankPredictor(H, I, 8), 0.0, {}) for i in range(model.config.num_hidden_layers)]
    save_predictors(ckpt, fitted, {"num_experts": 1, "hidden_size": H, "intermediate_size": I})
    return ckpt


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return engine_checkpoint(tmp_path_factory.mktemp("runtime-cli"))


def expected_text(ckpt, ids, mode="sparse", n=12, stop_ids=(), predictor_dtype=None):
    """The engine's greedy tokens for ids, decoded: what the CLI must print."""
    engine = Engine.load(ckpt, mode=mode, context=256, progress=False, predictor_dtype=predictor_dtype)
    tokens = list(engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=stop_ids)))
    return engine.tokenizer.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_generate_prints_the_engines_greedy_tokens(ckpt, mode, capsys):
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    assert main(["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--mode", mode, "--max-new-tokens", "12",
                 "--ignore-eos", "--context", "256", "--no-progress", "--stats"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out == expected_text(ckpt, ids, mode) + "\n"
    stats = err.strip().splitlines()[-1]
    assert stats.startswith("stats: ") and f"mode={mode}" in stats and "decode_tokens=11" in stats


def test_generate_with_int8_predictors(ckpt, capsys):
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    assert main(["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--max-new-tokens", "12", "--ignore-eos", "--context", "256",
                 "--no-progress", "--predictor-dtype", "int8"]) == 0  # fmt: skip
    assert capsys.readouterr().out == expected_text(ckpt, ids, predictor_dtype="int8") + "\n"


def chat_ids(messages):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_generate_uses_the_chat_template_by_default_and_cuts_at_a_stop_string(ckpt, capsys):
    ids = chat_ids([{"role": "user", "content": PROMPT}])
    want = expected_text(ckpt, ids, "dense", 16)
    common = ["generate", str(ckpt), "--prompt", PROMPT, "--mode", "dense", "--max-new-tokens", "16", "--ignore-eos", "--no-progress"]
    assert main(common) == 0
    assert capsys.readouterr().out == want + "\n"
    stop = want[len(want) // 2 : len(want) // 2 + 3]
    assert main([*common, "--stop", stop]) == 0
    assert capsys.readouterr().out == want[: want.index(stop)] + "\n"


def test_generate_disk_backed_equals_resident(ckpt, capsys):
    args = ["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--mode", "sparse", "--max-new-tokens", "10", "--ignore-eos", "--no-progress",
            "--context", "64"]  # fmt: skip
    assert main(args) == 0
    resident = capsys.readouterr().out
    assert main([*args, "--fast-memory", "25%", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == resident and "units.misses=" in err


def test_generate_on_the_device_tier_equals_the_cpu_engine(ckpt, capsys):
    """--device cpu --device-memory 25%: hot neurons on the device side, cold ones on the CPU; oracle mode gives the
    exact model's tokens, as the CPU engine does."""
    args = ["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--mode", "oracle", "--max-new-tokens", "10", "--ignore-eos", "--no-progress", "--context", "64"]
    assert main(args) == 0
    cpu = capsys.readouterr().out
    assert main([*args, "--device", "cpu", "--device-memory", "25%", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == cpu and "device.hot_fraction=0.25" in err


def test_chat_keeps_history_until_reset(ckpt, monkeypatch, capsys):
    def reply(messages):
        return expected_text(ckpt, chat_ids(messages), "screen", 6, stop_ids=(0,))  # the default mode, auto, screens a dReLU MLP

    first = reply([{"role": "user", "content": "hello"}])
    second = reply([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first}, {"role": "user", "content": "add"}])
    after_reset = reply([{"role": "user", "content": "add"}])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nadd\n/reset\nadd\n"))
    assert main(["chat", str(ckpt), "--max-new-tokens", "6", "--no-progress", "--context", "256"]) == 0
    assert capsys.readouterr().out == f"{first}\n{second}\n{after_reset}\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--context", "8", "--max-new-tokens", "4"], "exceed --context 8"),
        (["--fast-memory", "1KB"], "below"),
        (["--fast-memory", "0%"], "--fast-memory 0% leaves no room for the neuron cache"),
        (["--mode", "screen", "--weight-dtype", "int8"], "--mode screen needs float weights (--weight-dtype float32"),
        (["--device-memory", "25%"], "--device-memory 25% needs --device"),
        (["--device", "quantum"], "--device 'quantum' is not a device"),
        (["--device", "cpu", "--device-memory", "1KB"], "--device-memory 1KB"),
    ],
)
def test_bad_input_is_one_line(ckpt, capsys, extra, message):
    assert main(["generate", str(ckpt), "--prompt", PROMPT * 2, "--raw", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_sparse_mode_without_predictors_is_said_in_flags(ckpt, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("predictors.*"))
    assert main(["generate", str(bare), "--prompt", PROMPT, "--raw", "--max-new-tokens", "4", "--no-progress", "--stats"]) == 0
    assert "mode=screen" in capsys.readouterr().err  # the default, auto, needs no predictors for a dReLU MLP
    assert main(["generate", str(bare), "--prompt", PROMPT, "--mode", "sparse", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"sparseforge generate: error: {bare}/predictors.json does not exist; run `sparseforge predictors train {bare}` first, "
                   "or run without predictors: --mode screen, oracle or dense")  # fmt: skip


def test_generate_says_why_nothing_was_generated(ckpt, tmp_path, capsys):
    """A checkpoint whose end-of-text token is the first one greedy decoding picks: stdout is empty, stderr says why."""
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    first = next(iter(Engine.load(ckpt, mode="dense", context=64, progress=False).generate(ids, GenerationConfig(max_new_tokens=1))))
    ends = tmp_path / "ends-at-once"
    shutil.copytree(ckpt, ends)
    (ends / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    assert main(["generate", str(ends), "--prompt", PROMPT, "--raw", "--mode", "dense", "--no-progress", "--context", "256"]) == 0
    out, err = capsys.readouterr()
    token = tiny_tokenizer().convert_ids_to_tokens(first)
    assert out == "\n" and err.strip() == (
        f"sparseforge generate: nothing to print: the model ended the text at once with its end-of-text token {token}; "
        "try a longer or different prompt, --raw or --chat-template, sampling (--temperature 0.8), or --ignore-eos"
    )
    stop = expected_text(ckpt, ids, "dense", 4)[:2]  # a stop string the text begins with
    assert main(["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--mode", "dense", "--no-progress", "--context", "256", "--stop", stop]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and f"nothing to print: the text began with the stop string {stop!r}" in err
    assert main(["generate", str(ckpt), "--prompt", PROMPT, "--raw", "--mode", "dense", "--no-progress", "--context", "256"]) == 0
    assert "nothing to print" not in capsys.readouterr().err


def test_chat_says_why_a_reply_is_empty(ckpt, tmp_path, monkeypatch, capsys):
    """A turn that ends at once prints an empty line and, on stderr, why and what to try; a turn with text does not."""
    ids = chat_ids([{"role": "user", "content": "hello"}])
    first = next(iter(Engine.load(ckpt, mode="dense", context=256, progress=False).generate(ids, GenerationConfig(max_new_tokens=1))))
    ends = tmp_path / "ends-at-once"
    shutil.copytree(ckpt, ends)
    (ends / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(ends), "--mode", "dense", "--no-progress", "--context", "256"]) == 0
    out, err = capsys.readouterr()
    token = tiny_tokenizer().convert_ids_to_tokens(first)
    assert out == "\n" and err.strip().splitlines()[-1] == (
        f"(no reply: the model ended the text at once with its end-of-text token {token}; rephrase the message, /reset, or sample "
        "(start chat with --temperature 0.8))"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(ckpt), "--mode", "dense", "--max-new-tokens", "4", "--no-progress", "--context", "256"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "no reply" not in err


def test_chat_without_template_is_an_error(tmp_path, capsys):
    plain = engine_checkpoint(tmp_path, chat_template=False)
    assert main(["chat", str(plain), "--mode", "dense", "--no-progress"]) == 2
    assert "no chat template" in capsys.readouterr().err
