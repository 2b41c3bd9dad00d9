"""Training under faults: a full disk during a state save, states left half-written or half-deleted, and the
process killed (SIGKILL) at chosen points, inside state saves included. Every time the run is resumed from
the newest complete state, and its final weights are bit-identical to an uninterrupted run's."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator
from safetensors.torch import load_file
from tiny import tiny_recipe

from sparseforge.errors import SparseforgeError
from sparseforge.train.loop import train
from sparseforge.train.recipe import load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")
DRIVER = Path(__file__).parent / "fault_driver.py"
SETTINGS = dict(max_steps=4, save_every=1, eval_every=0, keep_final_state=True)  # a state after every step


def _recipe(workspace, out, **overrides):
    return load_recipe(raw=tiny_recipe(workspace, out, **{**SETTINGS, **overrides}))


def _weights(ckpt) -> dict[str, torch.Tensor]:
    return load_file(Path(ckpt) / "model.safetensors")


def _assert_bit_identical(ckpt, reference):
    weights = _weights(ckpt)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference), "resumed weights differ from the uninterrupted run"


def _resume(workspace, out, **overrides):
    """What a user does after a crash: --resume, or start again when no state was completed."""
    try:
        return train(_recipe(workspace, out, **overrides), resume=True, progress=False)
    except SparseforgeError as e:
        assert "no saved state" in str(e)
        return train(_recipe(workspace, out, **overrides), progress=False)


def _assert_clean(run_dir):
    """Nothing half-written is left in the state directory, and every state in it is complete."""
    state = run_dir / "state"
    assert not [p.name for p in state.iterdir() if p.name.startswith(".")]
    for step in state.glob("step-*"):
        data = json.loads((step / "data.json").read_text())
        assert all((step / name).stat().st_size == size for name, size in data["files"].items())


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory, one_thread):
    """Final weights of the uninterrupted run."""
    return _weights(train(_recipe(workspace, tmp_path_factory.mktemp("ref") / "run"), progress=False))


def test_resume_skips_half_written_and_half_deleted_states(workspace, tmp_path, reference):
    run = tmp_path / "run"
    train(_recipe(workspace, run, keep_states=4), progress=False, stop_after=3)  # states 1, 2, 3
    state = run / "state"
    optimizer = state / "step-000003" / "optimizer.bin"
    os.truncate(optimizer, optimizer.stat().st_size // 2)  # a torn file the disk never got in full
    (state / "step-000002" / "model.safetensors").unlink()  # a deletion cut short
    (state / ".step-000004.tmp-save").mkdir()  # a save that never finished
    (state / ".step-000004.tmp-save" / "model.safetensors").write_bytes(b"half")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.2')  # a line a crash cut off
    train(_recipe(workspace, run, keep_states=1), resume=True, progress=False, stop_after=2)
    assert sorted(p.name for p in state.glob("step-*")) == ["step-000002"]  # the new state kept, the damaged ones gone
    ckpt = train(_recipe(workspace, run, keep_states=1), resume=True, progress=False)
    _assert_bit_identical(ckpt, reference)
    _assert_clean(run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line.get("event") == "resume"] == [1, 2]


def test_resume_never_loads_a_state_with_a_torn_data_json(workspace, tmp_path):
    run = tmp_path / "run"
    train(_recipe(workspace, run), progress=False, stop_after=1)
    (run / "state" / "step-000001" / "data.json").write_text('{"step": 1, "mix')
    with pytest.raises(SparseforgeError, match="no saved state"):
        train(_recipe(workspace, run), resume=True, progress=False)


NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds an fd's path in /proc")


@pytest.mark.parametrize("where", ["save_state", pytest.param("fsync", marks=NEEDS_PROC)])
def test_full_disk_during_a_state_save_resumes_from_the_last_complete_state(workspace, tmp_path, reference, monkeypatch, where):
    """ENOSPC while accelerate writes the state of step 3 (after its files are out), or while the state's files are
    flushed: training stops with the error, state 3 never appears, and --resume continues from state 2."""
    run = tmp_path / "run"
    calls = []

    def enospc(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "save_state":
        original = Accelerator.save_state

        def save_state(self, output_dir=None, **kwargs):
            result = original(self, output_dir, **kwargs)
            if "step-000003" in str(output_dir):
                enospc()
            return result

        monkeypatch.setattr(Accelerator, "save_state", save_state)
    else:
        fsync = os.fsync

        def flaky_fsync(fd):
            if ".step-000003.tmp-save/" in os.readlink(f"/proc/self/fd/{fd}"):
                calls.append(fd)
                if len(calls) == 3:  # the third file of state 3 to be flushed
                    enospc()
            return fsync(fd)

        monkeypatch.setattr(os, "fsync", flaky_fsync)
    with pytest.raises(OSError) as failure:
        train(_recipe(workspace, run), progress=False)
    assert failure.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in (run / "state").glob("step-*")) == ["step-000001", "step-000002"]
    assert not (run / "checkpoint").exists()
    _assert_bit_identical(train(_recipe(workspace, run), resume=True, progress=False), reference)
    _assert_clean(run)


# SIGKILL at each kind of point, the how-many-th drawn at random (seeded): a state save cut anywhere, an old
# state's deletion cut short, the final checkpoint half written, a plain step.
_draw = random.Random(0)
KILLS = [
    ("step", _draw.randint(1, 4)),
    ("save-files", _draw.randint(1, 4)),
    ("save-torn", _draw.randint(2, 4)),
    ("save-rename", _draw.randint(1, 4)),
    ("save-pruned", _draw.randint(1, 3)),
    ("prune", _draw.randint(1, 2)),
    ("checkpoint", 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("point,n", KILLS, ids=[f"{p}-{n}" for p, n in KILLS])
def test_killed_run_resumes_bit_identical(workspace, tmp_path, reference, point, n):
    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(workspace, run, **SETTINGS, keep_states=1), sort_keys=False))  # source order matters
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, str(DRIVER), str(recipe), point, str(n)], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, f"the kill point was not reached:\n{killed.stderr[-2000:]}"
    _assert_bit_identical(_resume(workspace, run, keep_states=1), reference)
    _assert_clean(run)
