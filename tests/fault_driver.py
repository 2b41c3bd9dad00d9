"""Run a training recipe and SIGKILL this process at a chosen point: the crash tests/test_faults_train.py resumes from.

    python tests/fault_driver.py RECIPE.yaml POINT N

POINT, the N-th time it is reached (counting from 1):
    step          an optimizer step, before it updates the weights
    save-files    a state save: accelerate has written its files, data.json is not written yet
    save-torn     as save-files, with the largest file of the state cut to half its size (unflushed data lost)
    save-rename   a state save: complete under its temporary name, not renamed yet
    save-pruned   a state save: renamed into place, older states not deleted yet
    prune         the deletion of an old state: half of its files gone
    checkpoint    the final checkpoint: half assembled in its temporary directory

Exits normally (status 0) if the point is never reached, which the tests treat as a failure.
"""

import os
import shutil
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator


def die(*_, **__) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def hook(owner, name: str, n: int, before=None, after=None, when=lambda *a, **k: True) -> None:
    """Wrap owner.name: on its n-th call for which `when` holds, run `before` / `after` around the original."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        hit = False
        if when(*args, **kwargs):
            calls[0] += 1
            hit = calls[0] == n
        if hit and before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if hit and after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def tear(self, output_dir, *_, **__) -> None:
    largest = max((p for p in Path(output_dir).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    die()


def half_removed(path, *_, **__) -> None:
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    for p in files[: len(files) // 2]:
        p.unlink()
    die()


def is_state(src, dst, *_, **__) -> bool:
    return Path(dst).name.startswith("step-")


POINTS = {
    "step": lambda n: hook(torch.optim.AdamW, "step", n, before=die),
    "save-files": lambda n: hook(Accelerator, "save_state", n, after=die),
    "save-torn": lambda n: hook(Accelerator, "save_state", n, after=tear),
    "save-rename": lambda n: hook(os, "replace", n, before=die, when=is_state),
    "save-pruned": lambda n: hook(os, "replace", n, after=die, when=is_state),
    "prune": lambda n: hook(shutil, "rmtree", n, before=half_removed, when=lambda p, *a, **k: ".tmp-removed-" in str(p)),
    "checkpoint": lambda n: hook(shutil, "copyfile", n, before=die, when=lambda src, dst, *a, **k: ".checkpoint.tmp-" in str(dst)),
}


def main() -> int:
    recipe, point, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)  # the resumed run in the test process computes with one thread too
    POINTS[point](n)
    from sparseforge.train.cli import main as train_main

    return train_main(["--config", recipe, "--no-progress"])


if __name__ == "__main__":
    sys.exit(main())
