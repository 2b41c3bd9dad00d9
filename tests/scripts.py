"""The repository's folders for tests, and benchmarks/ scripts loaded as modules (they are scripts, not a package)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
BENCHMARKS = ROOT / "benchmarks"


def load_script(name: str):
    """benchmarks/<name>.py as a module named bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
