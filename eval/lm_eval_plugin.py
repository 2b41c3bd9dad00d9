"""Make `lm_eval --model sparseforge` resolve, although lm-eval 0.4.13 has no plugin discovery.

lm-eval 0.4.13 resolves `--model NAME` in its model registry before any user code runs: the registry is
filled from a fixed table in `lm_eval/models/__init__.py` (no entry points; `--include_path` YAML is indexed
without importing Python). So sparseforge adds itself to that registry right after lm-eval builds it:

- `register()`: fill lm-eval's registry and add "sparseforge" as a lazy placeholder
  ("sparseforge.eval.adapter:SparseforgeLM"; torch and the adapter load only when the model is used).
- `install_hook()`: a meta-path finder that calls `register()` as soon as `lm_eval.models` has been imported,
  in any process. A one-line `.pth` file in site-packages runs it at interpreter start-up:
  `sparseforge lm-eval-plugin --install` writes that file. The line loads this file by path under a private
  name, so start-up imports neither sparseforge (the clean-load check forbids it) nor lm-eval nor torch;
  errors are swallowed so a moved checkout cannot break the interpreter.
- `python -m sparseforge.eval.lm_eval_plugin ARGS`: the `lm_eval` command with "sparseforge" registered,
  for an environment without the `.pth` file.
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig

MODEL_NAME = "sparseforge"
TARGET = "sparseforge.eval.adapter:SparseforgeLM"
PTH_NAME = "sparseforge_lm_eval.pth"
_HOOK_MODULE = "_sparseforge_lm_eval_hook"
_WATCHED = "lm_eval.models"


def register() -> None:
    """Add "sparseforge" to lm-eval's model registry (idempotent)."""
    importlib.import_module(_WATCHED)  # the built-in table first: get_model() fills it only when the registry is empty
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


def pth_line() -> str:
    """The start-up line: load this file as a private module and install the hook (module docstring)."""
    body = (
        "try:\n import importlib.util as u\n"
        f" s = u.spec_from_file_location({_HOOK_MODULE!r}, {os.path.realpath(__file__)!r})\n"
        " m = u.module_from_spec(s)\n s.loader.exec_module(m)\n m.install_hook()\n"
        "except Exception:\n pass\n"
    )
    return f"import sys; exec({body!r})\n"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds `lm_eval.models` like the normal finders do, and registers sparseforge once it has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != _WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
            register()

        spec.loader.exec_module = exec_and_register
        return spec


def install_hook() -> None:
    """Register now if lm-eval's models are loaded, else as soon as they are (called from the .pth file)."""
    if _WATCHED in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def pth_path():
    """Where the start-up file goes (a pathlib.Path): this interpreter's site-packages (purelib). pathlib is
    imported here, not at module level, because the start-up hook loads this module in every interpreter."""
    from pathlib import Path

    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main() -> None:
    """`lm_eval` with the sparseforge model registered."""
    register()
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
