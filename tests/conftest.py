import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import TEXT, tied_halves_checkpoint, tiny_model, tiny_tokenizer, word_documents  # noqa: E402


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A tiny dense Llama (model + tokenizer) and web/code/math jsonl.gz sources: root/dense, root/data/*."""
    root = tmp_path_factory.mktemp("train")
    tiny_model("llama").save_pretrained(root / "dense")
    tiny_tokenizer().save_pretrained(root / "dense")
    for i, name in enumerate(["web", "code", "math"]):
        (root / "data" / name).mkdir(parents=True)
        with gzip.open(root / "data" / name / "sample.jsonl.gz", "wt") as f:
            for d in range(60):
                f.write(json.dumps({"text": f"{name} document {d}. " + TEXT[(i + d) % len(TEXT)] * (1 + d % 3)}) + "\n")
    return root


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """Token stores of every test go to a temporary folder, never the user's cache."""
    import os

    before = os.environ.get("SPARSEFORGE_CACHE")
    os.environ["SPARSEFORGE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("SPARSEFORGE_CACHE", None)
    else:
        os.environ["SPARSEFORGE_CACHE"] = before


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread avoids oversubscription on a shared 2-core machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tied_pairs_ckpt(tmp_path_factory):
    """(a tiny checkpoint of tied halves with a profile and pair predictors trained through the CLI to recall 0.8, so
    that their mask changes the output; its HF model; the CLI's data arguments). Shared: tests copy it before changing it."""
    from sparseforge.cli import main

    root = tmp_path_factory.mktemp("pairs")
    text = word_documents(root / "text.jsonl.gz", 300, numbered=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tied_halves_checkpoint(root / "ckpt")
    data = ["--data", str(text), "--seq-len", "32", "--no-progress"]
    assert main(["profile", str(root / "ckpt"), "--tokens", "256", "--coact-tokens", "64", "--block-size", "16", *data]) == 0
    assert main(["predictors", "train", str(root / "ckpt"), "--tokens", "1024", "--heldout-tokens", "256", "--budget", "0.5", "--target-recall", "0.8",
                 "--recall-margin", "0", "--max-epochs", "3", "--pilot-rank", "16", "--pilot-epochs", "1", "--min-rank", "8", *data]) == 0  # fmt: skip
    torch.set_num_threads(before)
    return root / "ckpt", model, data
