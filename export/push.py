"""`sparseforge push`: publish a sparse checkpoint on the Hugging Face Hub.

Order: (1) the checkpoint must load in a clean interpreter with plain transformers (`clean_load.py`), so a
repository never holds a model its users cannot load; (2) the file list (`--dry-run` stops here, no network,
no token); (3) a token from the usual places (HF_TOKEN, `hf auth login`), else a one-line error; (4) the model
card is regenerated into CKPT/README.md (`card.py`) and the listed files uploaded with `upload_folder`.

What goes up is what a user of the model needs, matched by name at the checkpoint's top level (HUB_FILES):
config, custom code, weights, tokenizer, predictors, profile, plans, measurements, scorecard and card.
Everything else stays local: the runtime's `neurons/` store (rebuilt from the weights on first use), eval's
partial results, training states, temporary files of interrupted writes.
"""

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from sparseforge.atomic import atomic_write_text
from sparseforge.errors import SparseforgeError


@dataclass(frozen=True)
class PushPlan:
    repo_id: str
    revision: str | None
    files: list[tuple[str, int]]  # (relative path, bytes) to upload
    card: str
    left_out: list[tuple[str, int]] = ()  # (top-level name, bytes) that stay local

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


HUB_FILES = (
    "config.json", "generation_config.json", "configuration_*.py", "modeling_*.py",  # the model and its code
    "model*.safetensors", "model.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "predictors.safetensors", "predictors.json", "profile.safetensors", "profile.json", "plan*.json",  # what the runtime reads
    "sparsity.json", "thresholds.json", "eval.json", "scorecard.json", "scorecard_*.png", "README.md",  # what the card reports
)  # fmt: skip


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def upload_files(ckpt: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(files that go up, top-level entries that stay local), each as (name, bytes), sorted by name. Hidden names
    (temporary files of interrupted writes) are neither."""
    up, local = [], []
    for path in sorted(p for p in Path(ckpt).iterdir() if not p.name.startswith(".")):
        wanted = path.is_file() and any(fnmatch(path.name, p) for p in HUB_FILES)
        (up if wanted else local).append((path.name + ("" if wanted or path.is_file() else "/"), _size(path)))
    return up, local


def check_loads(ckpt: Path) -> dict:
    """Logits of a few tokens from `ckpt` loaded in a clean interpreter (trust_remote_code); raises if it fails."""
    import torch

    from sparseforge.export.clean_load import clean_load_logits

    logits, info = clean_load_logits(ckpt, torch.tensor([[1, 2, 3, 4]]))
    if not torch.isfinite(logits).all():
        raise SparseforgeError(f"{ckpt} loads in a clean interpreter but gives non-finite logits; re-check its weights")
    return info


def plan_push(ckpt: str | Path, repo_id: str, revision: str | None = None) -> PushPlan:
    """What `push` would upload (the card regenerated for repo_id@revision) and what it leaves out."""
    from sparseforge.export.card import build_card

    ckpt = Path(ckpt)
    if not (ckpt / "config.json").is_file():
        raise SparseforgeError(f"{ckpt} is not a checkpoint directory (no config.json)")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise SparseforgeError(f"--repo-id {repo_id!r} must be ORG/NAME (or USER/NAME)")
    card = build_card(ckpt, repo_id, revision or "main")
    up, local = upload_files(ckpt)
    files = [(name, size) for name, size in up if name != "README.md"] + [("README.md", len(card.encode()))]
    return PushPlan(repo_id, revision, sorted(files), card, local)


def format_plan(plan: PushPlan) -> str:
    """Every file that would go up with its size, then what stays local."""
    lines = [f"{size:>14,d}  {name}" for name, size in plan.files]
    lines.append(f"{plan.total_bytes:>14,d}  total, {len(plan.files)} files -> {plan.repo_id}@{plan.revision or 'main'} (README.md: regenerated card)")
    if plan.left_out:
        skipped = ", ".join(f"{name} ({size:,d} bytes)" for name, size in plan.left_out)
        lines.append(f"not uploaded (not needed by users of the model): {skipped}")
    return "\n".join(lines)


def hub_token() -> str:
    """The Hub token from HF_TOKEN or the `hf auth login` store; SparseforgeError when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise SparseforgeError("no Hugging Face token found; set HF_TOKEN=hf_... or run `hf auth login` (or use --dry-run)")
    return token


def push(ckpt: str | Path, plan: PushPlan, private: bool = False) -> str:
    """Write the card into the checkpoint and upload the folder; returns the commit URL."""
    from huggingface_hub import HfApi

    token = hub_token()
    api = HfApi(token=token)
    api.create_repo(plan.repo_id, private=private, exist_ok=True)
    if plan.revision:
        api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)
    atomic_write_text(Path(ckpt) / "README.md", plan.card)
    commit = api.upload_folder(
        repo_id=plan.repo_id, folder_path=str(ckpt), revision=plan.revision,
        allow_patterns=[name for name, _ in plan.files], commit_message="Upload sparseforge checkpoint",
    )  # fmt: skip
    return commit.commit_url


def push_checkpoint(ckpt: str | Path, repo_id: str, private: bool = False, revision: str | None = None, dry_run: bool = False,
                    load_check: bool = True) -> PushPlan:
    """`sparseforge push`: check that `ckpt` loads in a clean interpreter, print every file that goes up with its
    size (and what stays local), then upload unless dry_run. Returns the plan."""
    plan = plan_push(ckpt, repo_id, revision)
    if not dry_run:
        hub_token()  # a missing token fails before the slow load check
    if load_check:
        info = check_loads(Path(ckpt))
        print(f"clean load ok: {info['class']} ({info['module']})")
    print(format_plan(plan))
    if dry_run:
        print("dry run: nothing uploaded")
    else:
        print(f"uploaded: {push(ckpt, plan, private=private)}")
    return plan
