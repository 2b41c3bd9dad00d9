"""The code passes the lint rules in pyproject.toml ([tool.ruff.lint]); `ruff check .` from the repository root
says where it does not."""

import subprocess
import sys

from scripts import ROOT


def test_ruff_check_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check . found:\n{out.stdout}{out.stderr}"
