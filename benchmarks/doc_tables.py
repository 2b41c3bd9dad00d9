"""Copy benchmark result tables into the docs, so that every table in docs/ is the one a benchmark wrote.

A doc marks a generated table with two comment lines; everything between them is replaced by the named file:

    <!-- table: benchmarks/results/recovery-cpu.md -->
    ...
    <!-- end table -->

    python benchmarks/doc_tables.py          # rewrite the marked blocks of docs/*.md and README.md
    python benchmarks/doc_tables.py --check  # exit 1 and name the blocks that differ from their result files
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table: (?P<file>\S+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def render(text: str, root: Path = ROOT) -> str:
    """The doc text with every marked block replaced by its result file."""

    def fill(m: re.Match) -> str:
        source = root / m["file"]
        if not source.is_file():
            raise SystemExit(f"doc table names {m['file']}, which does not exist; run its benchmark or fix the marker")
        return m.group(1) + source.read_text().rstrip("\n") + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def docs(root: Path = ROOT) -> list[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a marked table differs from its result file")
    args = p.parse_args(argv)
    stale = []
    for doc in docs():
        text = doc.read_text()
        new = render(text)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print("stale tables in " + ", ".join(map(str, stale)) + "; run: python benchmarks/doc_tables.py")
        return 1
    if not args.check:
        print("updated " + (", ".join(map(str, stale)) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
