"""The training data mixture: weighted sources, packed into fixed-length token windows, resumable.

Each source is a local glob (.jsonl/.jsonl.gz/.txt/.parquet) or a Hub dataset id (streamed; machines
with the Hub only). Its documents are read in a fixed order; document i is held out for validation when
i % val_every == 0 and never trained on. Training documents are tokenized, joined with EOS between
documents and cut into windows of seq_len tokens. Sources are interleaved by weight with a seeded RNG.

The whole position is a small dict (`state_dict()`): per source the epoch, the index of the next
document and the tokens left over from the current one; for the mixture the number of draws made. A run
restored from it sees exactly the windows an uninterrupted run would. Memory is bounded by one document.
"""

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sparseforge.data import data_root, expand, read_documents
from sparseforge.errors import SparseforgeError

MIXTURE_STATE_VERSION = 1


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float
    path: str | None = None  # glob; relative to the data root unless absolute
    hub: str | None = None  # Hub dataset id, streamed
    text_field: str = "text"
    split: str = "train"
    config_name: str | None = None  # Hub dataset config

    @classmethod
    def from_recipe(cls, name: str, entry: dict) -> "SourceSpec":
        return cls(name, float(entry.get("weight", 1.0)), entry.get("path"), entry.get("hub"),
                   entry.get("text_field", "text"), entry.get("split", "train"), entry.get("name"))


def iter_source_documents(spec: SourceSpec, root: Path | None = None) -> Iterator[str]:
    """All documents of a source, in a fixed order (files sorted, records in file order)."""
    if spec.hub:
        try:
            from datasets import load_dataset

            stream = load_dataset(spec.hub, spec.config_name, split=spec.split, streaming=True)
        except Exception as e:  # the Hub is unreachable, the id is wrong, ...
            raise SparseforgeError(f"source {spec.name!r}: cannot stream Hub dataset {spec.hub!r}: {str(e).splitlines()[0]}") from None
        for record in stream:
            if record.get(spec.text_field):
                yield record[spec.text_field]
        return
    pattern = Path(spec.path)
    if not pattern.is_absolute():
        pattern = (root or data_root()) / pattern
    for file in expand(str(pattern)):
        yield from read_documents(file, spec.text_field)


class SourceStream:
    """Training windows of one source; resumable through state_dict()."""

    def __init__(self, spec: SourceSpec, tokenizer, seq_len: int, val_every: int, root: Path | None = None):
        self.spec, self.tokenizer, self.seq_len, self.val_every, self.root = spec, tokenizer, seq_len, val_every, root
        self.epoch, self.next_doc, self.buffer = 0, 0, []
        self._docs: Iterator[tuple[int, str]] | None = None

    def _open(self) -> Iterator[tuple[int, str]]:
        docs = enumerate(iter_source_documents(self.spec, self.root))
        for index, doc in docs:  # fast-forward to the saved position (reading, not tokenizing)
            if index >= self.next_doc:
                yield index, doc
                break
        yield from docs

    def next_window(self) -> list[int]:
        """The next seq_len training tokens of this source (wrapping around into a new epoch)."""
        empty_epochs = 0
        while len(self.buffer) < self.seq_len:
            if self._docs is None:
                self._docs = self._open()
            item = next(self._docs, None)
            if item is None:  # end of the source: start the next epoch
                if self.next_doc == 0 or empty_epochs:
                    raise SparseforgeError(f"source {self.spec.name!r} has no training documents (all {self.next_doc} held out?); lower val_every or add data")
                self.epoch, self.next_doc, self._docs = self.epoch + 1, 0, None
                empty_epochs += 1
                continue
            index, doc = item
            self.next_doc = index + 1
            if index % self.val_every == 0:
                continue  # held out for validation
            self.buffer.extend(self.tokenizer(doc, add_special_tokens=False)["input_ids"])
            self.buffer.append(self.tokenizer.eos_token_id)
            empty_epochs = 0
        window, self.buffer = self.buffer[: self.seq_len], self.buffer[self.seq_len :]
        return window

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_doc": self.next_doc, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.next_doc, self.buffer = state["epoch"], state["next_doc"], list(state["buffer"])
        self._docs = None


class Mixture:
    """Interleaves SourceStreams by weight: each window's source is drawn from a seeded RNG."""

    def __init__(self, streams: list[SourceStream], seed: int):
        self.streams = {s.spec.name: s for s in streams}
        self.names = list(self.streams)
        self.weights = [s.spec.weight for s in streams]
        self.seed, self.draws = seed, 0
        self._rng = random.Random(seed)

    def next_window(self) -> tuple[str, list[int]]:
        name = self._rng.choices(self.names, self.weights)[0]
        self.draws += 1
        return name, self.streams[name].next_window()

    def next_batch(self, size: int) -> list[list[int]]:
        return [self.next_window()[1] for _ in range(size)]

    def state_dict(self) -> dict:
        return {
            "format_version": MIXTURE_STATE_VERSION,
            "seed": self.seed,
            "draws": self.draws,
            "sources": {name: s.state_dict() for name, s in self.streams.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format_version") != MIXTURE_STATE_VERSION or set(state["sources"]) != set(self.streams):
            raise SparseforgeError(
                f"saved data position does not fit this recipe (sources {sorted(state.get('sources', {}))} vs {sorted(self.streams)}); "
                "resume with the recipe the run started with"
            )
        self._rng = random.Random(state["seed"])
        for _ in range(state["draws"]):
            self._rng.choices(self.names, self.weights)
        self.seed, self.draws = state["seed"], state["draws"]
        for name, s in state["sources"].items():
            self.streams[name].load_state_dict(s)


def build_mixture(sources: dict, tokenizer, seq_len: int, val_every: int, seed: int, root: str | None = None) -> Mixture:
    """The recipe's `sources` mapping -> Mixture."""
    base = Path(root).expanduser() if root else None
    specs = [SourceSpec.from_recipe(name, entry) for name, entry in sources.items()]
    return Mixture([SourceStream(s, tokenizer, seq_len, val_every, base) for s in specs], seed)


def validation_windows(sources: dict, tokenizer, seq_len: int, val_every: int, val_tokens: int, root: str | None = None) -> dict[str, list[list[int]]]:
    """Per source, windows of the held-out documents (i % val_every == 0), up to val_tokens tokens."""
    base = Path(root).expanduser() if root else None
    out = {}
    for name, entry in sources.items():
        spec = SourceSpec.from_recipe(name, entry)
        buffer: list[int] = []
        windows: list[list[int]] = []
        for index, doc in enumerate(iter_source_documents(spec, base)):
            if index % val_every:
                continue
            buffer.extend(tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            while len(buffer) >= seq_len and len(windows) * seq_len < val_tokens:
                windows.append(buffer[:seq_len])
                buffer = buffer[seq_len:]
            if len(windows) * seq_len >= val_tokens:
                break
        if not windows:
            raise SparseforgeError(f"source {name!r} has fewer than {seq_len} held-out tokens; lower val_every or seq_len")
        out[name] = windows
    return out
