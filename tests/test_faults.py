"""Faults in a checkpoint directory: every file kind missing, truncated or overwritten with garbage, files that
do not fit each other, and a full disk (ENOSPC) during every kind of write. A loader either works on a complete
file or raises one SparseforgeError line naming the file and the command that writes it again; a write cut
short never leaves anything a loader takes for complete. (Training faults: tests/test_faults_train.py.)"""

import errno
import json
import os
import re
import shutil
import stat

import pytest
import torch
from tiny import profiled_checkpoint, tiny_model, tiny_tokenizer

from sparseforge import cli
from sparseforge.checkpoint import load_sparse, read_artifact, save_sparse
from sparseforge.errors import SparseforgeError
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.profile import load_profile, save_profile
from sparseforge.predictors.store import load_predictors, save_predictors
from sparseforge.runtime import bundles
from sparseforge.runtime.bundles import BundleFile, build_bundles
from sparseforge.runtime.engine import Engine
from sparseforge.runtime.plan import PlanRequest, load_plan, make_plan, write_plan
from sparseforge.runtime.sizes import parse_size
from sparseforge.runtime.store import tiered_units
from sparseforge.sparsify.convert import convert_model

pytestmark = pytest.mark.usefixtures("one_thread")
BUNDLE_BIN, BUNDLE_INDEX = "neurons/bundles-float32.bin", "neurons/bundles-float32.json"
LOADERS = {
    "load_sparse": load_sparse,
    "engine": lambda ckpt: Engine.load(ckpt, mode="sparse", context=64, progress=False),
    "make_plan": lambda ckpt: make_plan(ckpt, PlanRequest(parse_size("50%"), context=64)),
    "load_profile": load_profile,
    "load_predictors": load_predictors,
    "load_plan": load_plan,
    "neuron_store": lambda ckpt: tiered_units(ckpt, "plan.json", "float32", progress=False, build=False).close(),
    "bundle_file": lambda ckpt: BundleFile(ckpt, "float32").close(),
}
READERS = {  # file -> the loaders that read it
    "config.json": ("load_sparse", "engine", "make_plan"),
    "model.safetensors": ("load_sparse", "engine", "make_plan"),
    "tokenizer.json": ("load_sparse", "engine"),
    "profile.json": ("load_profile", "make_plan", "neuron_store"),
    "profile.safetensors": ("load_profile", "make_plan", "neuron_store"),
    "predictors.json": ("load_predictors", "engine"),
    "predictors.safetensors": ("load_predictors", "engine", "make_plan"),
    "plan.json": ("load_plan", "neuron_store"),
    BUNDLE_INDEX: ("bundle_file",),
    BUNDLE_BIN: ("bundle_file", "neuron_store"),
}
OPTIONAL = {("predictors.safetensors", "make_plan")}  # a plan without predictors reserves none: missing is fine there
DAMAGE = {
    "truncate": lambda p: os.truncate(p, p.stat().st_size // 2),
    "binary-garbage": lambda p: p.write_bytes(b"\xde\xad\xbe\xef" * 16 + p.read_bytes()[64:]),  # over a header or a JSON start
    "text-garbage": lambda p: p.write_bytes(p.read_bytes()[:8] + b"#garbage#garbage" + p.read_bytes()[24:]),  # inside one
    "delete": lambda p: p.unlink(),
}
FIX = re.compile(r"`sparseforge \w+|write the checkpoint again|rebuild it|build it|pass a sparse checkpoint")  # what to run


def _predictors(ckpt, seed: int = 1, rank: int = 8, hidden: int = 64) -> None:
    torch.manual_seed(seed)
    fitted = [FittedUnit(i, 0, LowRankPredictor(hidden, 128, rank), 0.0, {}) for i in range(2)]
    save_predictors(ckpt, fitted, {"num_experts": 1, "intermediate_size": 128})


@pytest.fixture(scope="module")
def complete(tmp_path_factory, one_thread):
    """A tiny checkpoint with every file kind: weights, tokenizer, profile, predictors, a plan, a bundle file."""
    ckpt, _, _ = profiled_checkpoint(tmp_path_factory.mktemp("faults"), "llama")
    _predictors(ckpt)
    write_plan(ckpt, make_plan(ckpt, PlanRequest(parse_size("50%"), context=64)))
    build_bundles(ckpt, "float32", progress=False)
    return ckpt


@pytest.fixture
def ckpt(complete, tmp_path):
    return shutil.copytree(complete, tmp_path / "ckpt")


def _error(loader: str, ckpt) -> str:
    with pytest.raises(SparseforgeError) as e:
        LOADERS[loader](ckpt)
    return str(e.value)


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", READERS)
def test_every_loader_names_a_damaged_file_and_its_fix(ckpt, name, damage):
    path = ckpt / name
    DAMAGE[damage](path)
    for loader in READERS[name]:
        if damage == "delete" and (name, loader) in OPTIONAL:
            continue
        message = _error(loader, ckpt)
        assert "\n" not in message, (loader, message)
        assert (path.name if damage == "delete" else str(path)) in message, (loader, message)
        assert FIX.search(message), (loader, message)
        if damage == "truncate":
            assert "truncated" in message, (loader, message)


def test_files_that_do_not_fit_each_other(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    for loader in ("load_sparse", "engine"):
        message = _error(loader, ckpt)
        assert re.search(r"model.safetensors holds model.layers.0.mlp.\w+_proj.weight of shape \[\d+, \d+\], config.json says", message)
    (ckpt / "config.json").write_text(json.dumps(config))

    _predictors(ckpt, rank=4, hidden=32)  # predictors of another model
    message = _error("engine", ckpt)
    assert "predictors.safetensors holds a predictor for layer 0 expert 0 of a model with (hidden, intermediate) = (32, 128)" in message

    plan = json.loads((ckpt / "plan.json").read_text())
    del plan["layers"]
    (ckpt / "plan.json").write_text(json.dumps(plan))
    assert "plan.json lacks 'layers'" in _error("load_plan", ckpt)


@pytest.mark.parametrize("kind", ["profile", "predictors"])
def test_a_pair_from_two_saves_is_refused(ckpt, kind):
    """<kind>.safetensors from one save beside <kind>.json from another: what a save interrupted between its two
    renames leaves. The loader refuses it instead of mixing two runs' numbers."""
    old_json = (ckpt / f"{kind}.json").read_bytes()
    if kind == "profile":
        tensors, report = load_profile(ckpt)
        save_profile(ckpt, tensors, report)
    else:
        _predictors(ckpt, seed=2)
    (ckpt / f"{kind}.json").write_bytes(old_json)
    assert "come from different saves" in _error(f"load_{kind}", ckpt)


# ---------------------------------------------------------------- a full disk


def _fail_fsync(monkeypatch, at: int = 1, inside: str = "") -> list:
    """os.fsync of regular files (every atomic write flushes before its rename) raises ENOSPC on the `at`-th call
    whose file path contains `inside`; returns the list of those calls."""
    fsync, calls = os.fsync, []

    def full(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode) and inside in os.readlink(f"/proc/self/fd/{fd}"):
            calls.append(fd)
            if len(calls) == at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    return calls


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob(".*"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds an fd's path in /proc")


@needs_proc
@pytest.mark.parametrize("at", [1, 4])
def test_full_disk_while_replacing_a_checkpoint_keeps_the_old_one(ckpt, monkeypatch, at):
    before = load_sparse(ckpt).state_dict()
    _fail_fsync(monkeypatch, at)
    with pytest.raises(OSError, match="No space left"):
        save_sparse(convert_model(tiny_model("llama", seed=5), "drelu"), tiny_tokenizer(), ckpt, force=True)
    monkeypatch.undo()
    after = load_sparse(ckpt).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _leftovers(ckpt.parent) == []


@needs_proc
@pytest.mark.parametrize("kind", ["profile", "predictors"])
@pytest.mark.parametrize("at", [1, 2])
def test_full_disk_while_writing_a_pair(ckpt, monkeypatch, kind, at):
    """ENOSPC on the tensors (1st file) keeps the old pair; on the JSON (2nd) leaves new tensors beside the old
    JSON, which the loader refuses: nothing half-new is loaded."""
    load = {"profile": load_profile, "predictors": load_predictors}[kind]
    before = load(ckpt)
    _fail_fsync(monkeypatch, at)
    with pytest.raises(OSError, match="No space left"):
        if kind == "profile":
            save_profile(ckpt, *before)
        else:
            _predictors(ckpt, seed=3)
    monkeypatch.undo()
    if at == 1:
        after = load(ckpt)
        old, new = (before[0], after[0]) if kind == "profile" else (before.predictors, after.predictors)
        assert all(torch.equal(old[k], new[k]) if kind == "profile" else torch.equal(old[k].fc1.weight, new[k].fc1.weight) for k in old)
    else:
        assert "come from different saves" in _error(f"load_{kind}", ckpt)
    assert _leftovers(ckpt) == []


@needs_proc
def test_full_disk_during_sparseforge_plan_is_one_line_and_keeps_the_old_plan(ckpt, monkeypatch, capsys):
    before = load_plan(ckpt)
    _fail_fsync(monkeypatch, inside="plan.json")
    assert cli.main(["plan", str(ckpt), "--fast-memory", "30%", "--context", "64", "--quiet"]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: the disk is full" in err and "Traceback" not in err
    assert load_plan(ckpt) == before
    assert _leftovers(ckpt) == []
    assert cli.disk_full(RuntimeError("file write failed: No space left on device (os error 28)"))  # native writers' errors
    assert not cli.disk_full(OSError(errno.EACCES, "Permission denied"))


def test_a_damaged_file_is_one_line_from_the_cli(ckpt, capsys):
    DAMAGE["truncate"](ckpt / "model.safetensors")
    assert cli.main(["plan", str(ckpt), "--fast-memory", "30%", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{ckpt / 'model.safetensors'} is truncated (" in err


class _FullDisk:
    """A file whose writes stop with ENOSPC once `room` bytes are in (the first write that crosses it lands in part)."""

    def __init__(self, path, mode, room: int):
        self.file, self.room = open(path, mode), room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.file.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_full_disk_while_rebuilding_the_neuron_store_keeps_the_old_bundle_file(ckpt, monkeypatch):
    """ENOSPC half way through the records of a rebuild: the old records file and index stay, and read as before."""
    bin_path = ckpt / BUNDLE_BIN
    data = bin_path.read_bytes()
    monkeypatch.setattr(bundles, "open", lambda path, mode="r": _FullDisk(path, mode, len(data) // 2), raising=False)
    with pytest.raises(OSError, match="No space left"):
        build_bundles(ckpt, "float32", progress=False)
    monkeypatch.undo()
    assert bin_path.read_bytes() == data and _leftovers(ckpt) == []
    store = tiered_units(ckpt, "plan.json", "float32", progress=False, build=False)
    store.close()


@needs_proc
def test_full_disk_between_the_records_and_the_index_is_refused(ckpt, monkeypatch):
    """The new records are renamed into place, the disk fills on the index: the old index does not describe the
    new records, and the store refuses them (with the fix) instead of reading another build's bytes."""
    _fail_fsync(monkeypatch, inside=BUNDLE_INDEX.split("/")[1])
    with pytest.raises(OSError, match="No space left"):
        build_bundles(ckpt, "float32", progress=False)
    monkeypatch.undo()
    assert "does not match its index" in _error("neuron_store", ckpt)
    assert _leftovers(ckpt) == []


def test_artifacts_read_by_every_stage_name_their_fix(tmp_path):
    (tmp_path / "scorecard.json").write_text('{"format_version": 1, "speed": {')
    with pytest.raises(SparseforgeError, match=r"scorecard.json is truncated .*re-run `sparseforge scorecard "):
        read_artifact(tmp_path, "scorecard", 1)
    (tmp_path / "sparsity.json").write_text("[1, 2]")
    with pytest.raises(SparseforgeError, match=r"sparsity.json is corrupted .*re-run `sparseforge measure "):
        read_artifact(tmp_path, "sparsity", 1)
