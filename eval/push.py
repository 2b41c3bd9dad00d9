"""`sparseforge push`: publish a sparse checkpoint on the Hugging Face Hub.

Order: (1) the checkpoint must load in a clean interpreter with plain transformers (`clean_load`), so a
repository never holds a model its users cannot load; (2) the file list (`--dry-run` stops here, no network,
no token); (3) a token from the usual places (HF_TOKEN, `hf auth login`), else a one-line error; (4) the model
card is regenerated into CKPT/README.md (eval/card.py) and the folder uploaded with `upload_folder`.
"""

from dataclasses import dataclass
from pathlib import Path

from sparseforge.checkpoint import atomic_write_text
from sparseforge.errors import SparseforgeError


@dataclass(frozen=True)
class PushPlan:
    repo_id: str
    revision: str | None
    files: list[tuple[str, int]]  # (relative path, bytes)
    card: str

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def upload_files(ckpt: Path) -> list[tuple[str, int]]:
    """Files that go up: everything in the checkpoint but hidden / temporary names (atomic-write leftovers)."""
    files = []
    for path in sorted(ckpt.rglob("*")):
        rel = path.relative_to(ckpt)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts) and "__pycache__" not in rel.parts:
            files.append((rel.as_posix(), path.stat().st_size))
    return files


def check_loads(ckpt: Path) -> dict:
    """Logits of a few tokens from `ckpt` loaded in a clean interpreter (trust_remote_code); raises if it fails."""
    import torch

    from sparseforge.clean_load import clean_load_logits

    logits, info = clean_load_logits(ckpt, torch.tensor([[1, 2, 3, 4]]))
    if not torch.isfinite(logits).all():
        raise SparseforgeError(f"{ckpt} loads in a clean interpreter but gives non-finite logits; re-check its weights")
    return info


def plan_push(ckpt: str | Path, repo_id: str, revision: str | None = None) -> PushPlan:
    from sparseforge.eval.card import build_card

    ckpt = Path(ckpt)
    if not (ckpt / "config.json").is_file():
        raise SparseforgeError(f"{ckpt} is not a checkpoint directory (no config.json)")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise SparseforgeError(f"--repo-id {repo_id!r} must be ORG/NAME (or USER/NAME)")
    card = build_card(ckpt, repo_id, revision or "main")
    files = [(name, size) for name, size in upload_files(ckpt) if name != "README.md"] + [("README.md", len(card.encode()))]
    return PushPlan(repo_id, revision, sorted(files), card)


def format_plan(plan: PushPlan) -> str:
    lines = [f"{size:>14,d}  {name}" for name, size in plan.files]
    lines.append(f"{plan.total_bytes:>14,d}  total, {len(plan.files)} files -> {plan.repo_id}@{plan.revision or 'main'} (README.md: regenerated card)")
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
