"""PowerInfer's `main` binary as a decode.py contestant: its GGUFs checked up front, its timing lines parsed."""

import re
import subprocess
from pathlib import Path

from sparseforge.errors import SparseforgeError

POWERINFER_TYPES = {"F32": ("fp32", "all F32"), "F16": ("fp16", "mostly F16"), "Q4_0": ("int8", "mostly Q4_0"), "Q4_1": ("int8", "mostly Q4_1")}
POWERINFER_TIMING = re.compile(r"llama_print_timings: +(prompt eval|eval) time = *([\d.]+) ms / *(\d+) (?:tokens|runs)")


def parse_powerinfer_log(stderr: str) -> dict:
    """What PowerInfer's main prints on stderr -> {"ftype": "mostly F16" | None, "weight_bytes": its "mem required"
    (MiB) in bytes | None, "prompt eval"/"eval": (seconds, tokens or runs)} (a timing line it did not print: absent)."""
    ftype = re.search(r"model ftype += (.+)", stderr)
    memory = re.search(r"mem required += *([\d.]+) MB", stderr)
    out = {"ftype": ftype.group(1).strip() if ftype else None, "weight_bytes": float(memory.group(1)) * 2**20 if memory else None}
    out.update({kind: (float(ms) / 1e3, int(count)) for kind, ms, count in POWERINFER_TIMING.findall(stderr)})
    return out


class PowerInfer:
    """PowerInfer's `main` binary on one of its GGUFs, greedy, EOS ignored. It tokenizes the prompt text itself and
    times itself: prefill from its "prompt eval time" line, decode from its "eval time" line (sampling excluded)."""

    def __init__(self, binary: Path, path: Path, label: str, text: str, context: int, threads: int):
        self.binary, self.path, self.label, self.text, self.context, self.threads = binary, path, label, text, context, threads
        self.name = f"PowerInfer {label} (checkpoint weights + predictors)"
        self.prompt_tokens, self.weight_bytes = None, None

    def run(self, ids, n):
        cmd = [str(self.binary), "-m", str(self.path), "-p", self.text, "-n", str(n), "-t", str(self.threads), "-c", str(self.context),
               "--temp", "0", "--repeat-penalty", "1.0", "--ignore-eos", "--log-disable"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            last = out.stderr.strip().splitlines()[-1:] or ["no output"]
            raise SparseforgeError(f"PowerInfer on {self.path} exited with status {out.returncode} ({last[0]}); run the command by hand: {' '.join(cmd[:4])} ...")
        log = parse_powerinfer_log(out.stderr)
        if log["ftype"] != POWERINFER_TYPES[self.label][1]:
            raise SparseforgeError(f"--powerinfer-gguf {self.label}={self.path}: PowerInfer loads it as {log['ftype']!r}; label it with its own type")
        if "prompt eval" not in log:
            raise SparseforgeError(f"PowerInfer on {self.path} printed no llama_print_timings lines; is {self.binary} PowerInfer's main?")
        self.weight_bytes = log["weight_bytes"]
        prompt_s, self.prompt_tokens = log["prompt eval"]
        eval_s, runs = log.get("eval", (0.0, 0))
        # prefill seconds at PowerInfer's own prompt rate for our prompt length (its tokenization may differ)
        return prompt_s * len(ids) / self.prompt_tokens, runs / eval_s if runs and eval_s else float("nan"), n

    def bytes_per_token(self):
        return None  # its sparse kernels skip the FFN rows its predictors drop and it does not count them


def powerinfer_ggufs(args) -> list[tuple[str, Path]]:
    """--powerinfer-gguf LABEL=PATH ... checked up front: (label, path) pairs, or [] without --powerinfer."""
    if args.powerinfer_gguf and not args.powerinfer:
        raise SparseforgeError("--powerinfer-gguf needs --powerinfer BIN (PowerInfer's main binary)")
    if not args.powerinfer:
        return []
    if not Path(args.powerinfer).is_file():
        raise SparseforgeError(f"--powerinfer {args.powerinfer}: no such file; build PowerInfer's main target (docs/powerinfer.md)")
    if not args.powerinfer_gguf:
        raise SparseforgeError(f"--powerinfer needs --powerinfer-gguf LABEL=PATH (LABEL one of {', '.join(POWERINFER_TYPES)})")
    out = []
    for item in args.powerinfer_gguf:
        label, _, path = item.partition("=")
        if label not in POWERINFER_TYPES or not path:
            raise SparseforgeError(f"--powerinfer-gguf {item!r}: give LABEL=PATH with LABEL one of {', '.join(POWERINFER_TYPES)}")
        if not Path(path).is_file():
            raise SparseforgeError(f"--powerinfer-gguf {item}: no such file; convert the checkpoint as in docs/benchmarks.md")
        with open(path, "rb") as f:
            if f.read(4) != b"PWRI":
                raise SparseforgeError(f"--powerinfer-gguf {item}: not a PowerInfer GGUF (no PWRI magic); make it with PowerInfer's convert.py")
        out.append((label, Path(path)))
    return out
