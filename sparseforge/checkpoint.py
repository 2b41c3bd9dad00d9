"""The sparse checkpoint directory: the only contract between stages.

Layout (see docs/formats.md):
    config.json                      base architecture config + `sparsity` dict + `auto_map`
    configuration_sparseforge.py     self-contained custom code (copied from sparsify/hf_code)
    modeling_sparseforge.py
    model*.safetensors               weights, key names of the base architecture
    tokenizer files, generation_config.json, README.md (model card)
    <artifact>.json                  plain-data artifacts of later stages, each with `format_version`

Every write is atomic (sparseforge.atomic): files are written to a temporary name and renamed into place; a
whole new checkpoint is assembled in a temporary sibling directory and renamed when complete.
"""

import json
import re
import shutil
from pathlib import Path

import torch

from sparseforge.atomic import atomic_directory, atomic_write_text
from sparseforge.errors import SparseforgeError
from sparseforge.families import family_for
from sparseforge.files import check_safetensors, damaged, open_safetensors, read_json, remedy, require_file

SPARSITY_FORMAT_VERSION = 1
# config.json `sparsity` fields that record where the weights came from and how long they trained: history, not
# part of the computation (convert writes `source`, train adds the token counts)
SPARSITY_PROVENANCE = ("source", "trained_tokens", "layerwise_tokens")
HF_CODE_FILES = ("configuration_sparseforge.py", "modeling_sparseforge.py")


def _hf_code_dir() -> Path:
    # installed layout: sparseforge/sparsify/hf_code lives wherever the subpackage was mapped
    from sparseforge.sparsify import hf_code

    return Path(hf_code.__file__).resolve().parent


def write_artifact(ckpt: str | Path, name: str, data: dict, format_version: int) -> Path:
    """Write `<ckpt>/<name>.json` atomically, stamped with its format_version."""
    path = Path(ckpt) / f"{name}.json"
    atomic_write_text(path, json.dumps({"format_version": format_version, **data}, indent=1) + "\n")
    return path


def read_artifact(ckpt: str | Path, name: str, format_version: int, keys: tuple[str, ...] = ()) -> dict:
    """Read `<ckpt>/<name>.json`, checking that it is complete JSON, that its format_version is the one this code
    reads and that it has `keys`; SparseforgeError naming the file and the command that writes it otherwise."""
    path = Path(ckpt) / f"{name}.json"
    data = read_json(path)
    if data.get("format_version") != format_version:
        raise SparseforgeError(
            f"{path} has format_version {data.get('format_version')!r}, this sparseforge reads {format_version}; {remedy(path)}"
        )
    missing = [k for k in keys if k not in data]
    if missing:
        raise damaged(path, f"lacks {', '.join(map(repr, missing))} (edited or written by another program)")
    return data


def sparsity_settings(config) -> dict:
    """The `sparsity` dict of a sparse config, checked."""
    s = getattr(config, "sparsity", None)
    if not isinstance(s, dict):
        raise SparseforgeError("config has no `sparsity` settings: not a sparseforge checkpoint; convert it first (sparseforge convert)")
    if s.get("format_version") != SPARSITY_FORMAT_VERSION:
        raise SparseforgeError(
            f"sparsity format_version {s.get('format_version')!r} in config.json; this sparseforge reads {SPARSITY_FORMAT_VERSION}"
        )
    return s


def sparse_config(base_config, activation: str, thresholds: list[float] | None, source: str | None = None):
    """The sparse config of a dense base config: same fields, sparse model_type, `sparsity`, `auto_map`.
    source: the dense model spec it was converted from (recorded so eval can score the original)."""
    family = family_for(base_config.model_type)
    config_cls, model_cls = family.classes()
    fields = {k: v for k, v in base_config.to_dict().items() if not k.startswith("_")}
    for key in ("model_type", "architectures", "quantization_config", "auto_map", "transformers_version", "sparsity"):
        fields.pop(key, None)
    sparsity = {
        "format_version": SPARSITY_FORMAT_VERSION,
        "activation": activation,
        "thresholds": thresholds,
        "base_model_type": family.base_model_type,
    }
    if source is not None:
        sparsity["source"] = source
    config = config_cls(**fields, sparsity=sparsity)
    config.architectures = [model_cls.__name__]
    config.auto_map = {
        "AutoConfig": f"configuration_sparseforge.{config_cls.__name__}",
        "AutoModelForCausalLM": f"modeling_sparseforge.{model_cls.__name__}",
    }
    return config


def check_output(out: str | Path, force: bool) -> None:
    """Refuse an existing output directory unless `force` (callers check before slow work, writers again)."""
    if Path(out).exists() and not force:
        raise SparseforgeError(f"output {str(out)!r} already exists; choose another --out or pass --force to replace it")


def save_sparse(model, tokenizer, out: str | Path, force: bool = False, card: str | None = None) -> Path:
    """Write a complete sparse checkpoint to `out` atomically (assembled in a temp dir, then renamed)."""
    out = Path(out)
    check_output(out, force)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name in HF_CODE_FILES:
            shutil.copyfile(_hf_code_dir() / name, tmp / name)
        if card:
            (tmp / "README.md").write_text(card)
    return out


def load_config(ckpt: str | Path):
    """The checked sparse config of checkpoint `ckpt`, as sparseforge's own config class of its family."""
    path = Path(ckpt) / "config.json"
    config_cls, _ = family_for(read_json(path).get("model_type", "?")).classes()
    try:
        config = config_cls.from_pretrained(ckpt)
    except (ValueError, TypeError, KeyError) as e:  # JSON, but not a config of its model type
        raise damaged(path, f"is corrupted ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    sparsity_settings(config)
    return config


def load_sparse(path: str | Path, dtype=torch.float32):
    """Load a sparse checkpoint with sparseforge's own copy of the classes it carries; a missing, truncated or
    corrupted file (weights, config, tokenizer), or weights that do not fit config.json, is a SparseforgeError
    naming the file."""
    config = load_config(path)
    check_weights(path, config)
    check_tokenizer(path)
    return family_for(config.model_type).classes()[1].from_pretrained(path, config=config, dtype=dtype)


def check_tokenizer(ckpt: str | Path) -> None:
    """The checkpoint's tokenizer files must be there (tokenizer.json, or a slow tokenizer's vocabulary) and parse."""
    ckpt = Path(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ckpt / name).is_file():
            read_json(ckpt / name)
    if not any((ckpt / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        require_file(ckpt / "tokenizer.json")


def check_weights(ckpt: str | Path, config) -> dict[str, list[int]]:
    """Check that the checkpoint's weight files are complete and hold every tensor of the model `config`
    describes, each with the shape it needs (the model is built on the meta device to know them).
    Returns {tensor name: shape} of what is stored."""
    files = weight_files(ckpt)
    with torch.device("meta"):
        want = {k: list(v.shape) for k, v in family_for(config.model_type).classes()[1](config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)  # stored once, as the embedding
    stored = {}
    for file in files:
        with open_safetensors(file) as f:
            for key in f.keys():
                stored[key] = got = list(f.get_slice(key).get_shape())
                if key in want and got != want[key]:
                    raise damaged(file, f"holds {key} of shape {got}, config.json says {want[key]}: the weights do not fit the config")
    missing = sorted(set(want) - set(stored))
    if missing:
        where = files[0] if len(files) == 1 else Path(ckpt) / "model.safetensors.index.json"
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise damaged(where, f"lacks {', '.join(missing[:2])}{more}, which config.json's model needs")
    return stored


def weight_files(ckpt: str | Path) -> list[Path]:
    """The checkpoint's weight files (model.safetensors, or the shards its index lists), each checked complete."""
    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise damaged(index, "lacks its weight_map")
        names = sorted(set(weight_map.values()))
    else:
        names = ["model.safetensors"]
    return [check_safetensors(ckpt / name) for name in names]


_CARD_SOURCE = re.compile(r"^# \S+ conversion of `([^`]+)`", re.MULTILINE)  # sparsify.convert.model_card's title


def recorded_source(ckpt: str | Path) -> str:
    """The model spec the checkpoint was converted from: config.json sparsity.source if present, else the
    title convert writes into the model card ("# drelu conversion of `smollm2-135m`")."""
    ckpt = Path(ckpt)
    sparsity = read_json(ckpt / "config.json").get("sparsity") or {}
    if sparsity.get("source"):
        return sparsity["source"]
    card = ckpt / "README.md"
    match = _CARD_SOURCE.search(card.read_text()) if card.is_file() else None
    if match is None:
        raise SparseforgeError(f"{ckpt} does not record the model it was converted from; pass --original SPEC (e.g. smollm2-135m)")
    return match.group(1)


def carry_source(config, ckpt: str | Path) -> str | None:
    """Copy the dense original recorded by checkpoint `ckpt` (recorded_source) into `config.sparsity["source"]`, for
    a model derived from it (thresholded, trained further), so eval's "original" row stays the dense model.
    Returns it, or None when `ckpt` records none (then nothing is claimed)."""
    try:
        source = recorded_source(ckpt)
    except (SparseforgeError, OSError):  # nothing recorded, or not a local checkpoint directory
        return None
    config.sparsity = {**config.sparsity, "source": source}
    return source
