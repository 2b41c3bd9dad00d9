"""Fill the generated blocks of README.md and docs/*.md, so that every table in the docs is one a command wrote.

A doc marks a generated block with two comment lines; everything between them is replaced:

    <!-- table: benchmarks/results/recovery-cpu.md -->     a benchmark's result file
    ...
    <!-- end table -->

    <!-- cli -->                                           every `sparseforge` command's arguments, from its parser
    <!-- end cli -->

    <!-- recipe-keys -->                                   every recipe key, its default and its comment (train/recipe.py)
    <!-- end recipe-keys -->

A result file's run line (date, load average) is shortened to the thread count, the machine its JSON records and
the command; paths outside the repository in it become `<file name>`.

    python benchmarks/doc_tables.py          # rewrite the marked blocks of docs/*.md and README.md
    python benchmarks/doc_tables.py --check  # exit 1 and name the docs whose blocks differ from what they'd be
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- (?P<kind>table|cli|recipe-keys)(?:: (?P<file>\S+))? -->\n)(?P<body>.*?)(?P<end><!-- end (?P=kind) -->)", re.S)
RUN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, (?P<threads>\d+ thread\(s\)), load average [^;]*; command: (?P<cmd>`.*`)$", re.M)
ABS_PATH = re.compile(r"(?<![\w.~>])/[\w.+-]+(?:/[\w.+-]+)+")


def _local_paths(text: str, root: Path) -> str:
    """Paths inside the repository relative to it, paths outside it as `<file name>`."""

    def fix(m: re.Match) -> str:
        path = Path(m[0])
        return str(path.relative_to(root)) if path.is_relative_to(root) else f"<{path.name}>"

    return ABS_PATH.sub(fix, text)


def result_table(path: Path, root: Path = ROOT) -> str:
    """A result file as the docs show it: the table and notes, then threads, machine and command."""
    if not path.is_file():
        raise SystemExit(f"doc table names {path.relative_to(root)}, which does not exist; run its benchmark or fix the marker")
    text = path.read_text().rstrip("\n")
    js = path.with_suffix(".json")
    env = json.loads(js.read_text()).get("environment", {}) if js.is_file() else {}
    machine = ", ".join(x for x in (env.get("cpu") or env.get("machine"), f"{env['cpus']} CPUs" if env.get("cpus") else None, env.get("gpu"),
                                    f"torch {env['torch']}" if env.get("torch") else None) if x)

    def run_line(m: re.Match) -> str:
        return f"{m['threads']}" + (f" on {machine}" if machine else "") + f"; command: {m['cmd']}"

    return _local_paths(RUN_LINE.sub(run_line, text), root)


def cli_reference() -> str:
    """Every `sparseforge` command: its description and a table of its arguments, from the argparse parsers."""
    from sparseforge.cli import build_parser

    # argparse wraps to the terminal (one line per argument here); help that names the data root shows the default
    saved = {k: os.environ.pop(k, None) for k in ("COLUMNS", "SPARSEFORGE_DATA")}
    os.environ["COLUMNS"] = "1000"
    try:
        out, seen = [], {}  # (flag, meaning) -> the first command listing it; later commands name 3 or more of its flags in one row
        for name, parser in _commands(build_parser()):
            out += [f"### `sparseforge {name}`", "", _one_line(parser.description or ""), "",
                    "```text", _one_line(parser.format_usage().removeprefix("usage: ")), "```", ""]
            rows = []
            for a in parser._actions:
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                    formatter = parser._get_formatter()
                    flag = formatter._format_action_invocation(a)
                    meaning = _one_line(formatter._expand_help(a)) if a.help and a.help != argparse.SUPPRESS else ""
                    first = seen.setdefault((flag, meaning), name) if a.option_strings else name
                    rows.append((first, a.option_strings[-1] if a.option_strings else flag, f"| `{flag}` | {meaning.replace('|', '&#124;')} |"))
            if rows:
                out += ["| argument | meaning |", "| --- | --- |"]
                groups = {f: [r for r in rows if r[0] == f] for f, _, _ in rows if f != name}
                for first, option, line in rows:
                    group = groups.get(first, [])
                    if len(group) < 3:
                        out.append(line)
                    elif option == group[0][1]:
                        out.append(f"| {', '.join(f'`{r[1]}`' for r in group)} | as in `sparseforge {first}` |")
                out.append("")
        return "\n".join(out).rstrip("\n")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
                if not nested:
                    yield prefix + name, sub
                yield from _commands(sub, prefix + name + " ")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def recipe_keys(root: Path = ROOT) -> str:
    """A table of the `Recipe` fields: key, default, the field's comment (train/recipe.py)."""
    source = (root / "train" / "recipe.py").read_text()
    body = source.split("class Recipe", 1)[1].split("\n    def ", 1)[0]
    field = re.compile(r"^    (?P<key>\w+): [^=#]+?(?: = (?P<default>.+?))?\s+# (?P<doc>.*)$", re.M)
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for m in field.finditer(body):
        default = m["default"] or "required"
        default = {"field(default_factory=list)": "[]", "field(default_factory=dict)": "{}"}.get(default, default)
        rows.append(f"| `{m['key']}` | `{default}` | {m['doc'].replace('|', '&#124;')} |")
    return "\n".join(rows)


def render(text: str, root: Path = ROOT) -> str:
    """The doc text with every marked block filled."""

    def fill(m: re.Match) -> str:
        if m["kind"] == "table":
            body = result_table(root / m["file"], root)
        elif m["kind"] == "cli":
            body = cli_reference()
        else:
            body = recipe_keys(root)
        return m.group(1) + body + "\n" + m["end"]

    return BLOCK.sub(fill, text)


def docs(root: Path = ROOT) -> list[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a marked block differs from what it would be")
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
        print("stale generated blocks in " + ", ".join(map(str, stale)) + "; run: python benchmarks/doc_tables.py")
        return 1
    if not args.check:
        print("updated " + (", ".join(map(str, stale)) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
