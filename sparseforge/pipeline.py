"""`sparseforge run RECIPE.yaml`: the whole pipeline, dense model -> scored, exported sparse model.

Every stage is a call of that stage's verb function in this process, printed before it runs as the equivalent
`sparseforge` command (so any stage can be re-run by hand); the checkpoint directory is the only thing stages
pass on. Every stage's options are checked before the first stage starts, and the training sources' files before
convert or train runs: a bad stage name or option, or a source matching no file, stops the run with one line naming
it. A stage is *up to date* when the run record (`OUTPUT_DIR/pipeline.json`) says it finished with the same command
line and settings, the files it read are unchanged since (size and mtime), and the files it writes exist;
up-to-date stages are skipped. Stages write atomically and training resumes from its latest state, so an interrupted run
continues where it stopped when the same command is given again.

    convert          sparseforge convert MODEL --activation A [--halves] --out OUTPUT_DIR/converted
    train            sparseforge train --config RECIPE (model: the converted checkpoint, teacher: MODEL)
    measure          sparseforge measure CKPT            -> sparsity.json
    profile          sparseforge profile CKPT            -> profile.safetensors/json
    predictors       sparseforge predictors train CKPT   -> predictors.safetensors/json
    predictors_calibrate  sparseforge predictors calibrate CKPT  -> predictors.json thresholds at the curve's knee
    predictors_eval  sparseforge predictors eval CKPT    -> predictors.json "eval"
    plan             sparseforge plan CKPT --fast-memory X --out plan-X.json (one per budget)
    eval             sparseforge eval CKPT               -> eval.json
    scorecard        sparseforge scorecard CKPT          -> scorecard.json, README.md
    export           sparseforge push CKPT               (--dry-run unless the recipe names a repo)

A recipe whose MODEL is already a sparse checkpoint (e.g. a thresholded one) skips convert and trains from
MODEL; the recipe then names the dense `teacher`.

CKPT is OUTPUT_DIR/checkpoint. The recipe's `stages:` mapping gives each stage's extra arguments (a
string, or a list of strings for several commands, or `false` to leave the stage out).
"""

import functools
import gc
import hashlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparseforge import summaries
from sparseforge.atomic import atomic_write_text
from sparseforge.errors import SparseforgeError
from sparseforge.files import read_json

RUN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Stage:
    name: str
    commands: Callable[["Run", list[str]], list[list[str]]]  # (run, extra-argument strings) -> argv lists
    inputs: Callable[["Run"], list[Path]]  # files read (fingerprinted)
    outputs: Callable[["Run", list[list[str]]], list[Path]]  # files that must exist afterwards
    summary: Callable[[Path], str]  # one line from the stage's artifacts in the checkpoint (sparseforge.summaries)


@dataclass
class Run:
    recipe_path: Path
    recipe: object  # sparseforge.train.recipe.Recipe
    overrides: list[str]
    progress: bool

    @property
    def dir(self) -> Path:
        return Path(self.recipe.output_dir)

    @functools.cached_property
    def starts_sparse(self) -> bool:
        """The recipe's model is already a sparse checkpoint (e.g. a thresholded one): nothing to convert."""
        config = Path(self.recipe.model) / "config.json"
        return config.is_file() and "sparsity" in read_json(config)

    @property
    def converted(self) -> Path:
        """The checkpoint training starts from."""
        return Path(self.recipe.model) if self.starts_sparse else self.dir / "converted"

    @property
    def ckpt(self) -> Path:
        return self.dir / "checkpoint"

    def training_settings(self) -> str:
        """Hash of every training key (the recipe minus `stages`), so an edited recipe retrains."""
        d = {k: v for k, v in self.recipe.to_dict().items() if k != "stages"}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _args(text: str) -> list[str]:
    return shlex.split(text) if text else []


def _no_progress(run: Run) -> list[str]:
    return [] if run.progress else ["--no-progress"]


# ---------------------------------------------------------------- stage table


def _convert(run: Run, extra: list[str]) -> list[list[str]]:
    r = run.recipe
    argv = ["convert", r.model, "--activation", r.activation, "--out", str(run.converted), "--force"]
    if r.threshold is not None:
        argv += ["--threshold", str(r.threshold)]
    if r.neuron_halves:
        argv += ["--halves"]
    return [argv + _args(extra[0])]


def _train(run: Run, extra: list[str]) -> list[list[str]]:
    argv = ["train", "--config", str(run.recipe_path)]
    for o in run.overrides:
        argv += ["--set", o]
    argv += ["--set", f"model={run.converted}"]
    if run.recipe.teacher is None and not run.starts_sparse:  # the converted checkpoint is sparse: name the dense original as the teacher
        argv += ["--set", f"teacher={run.recipe.model}"]
    return [argv + _no_progress(run) + _args(extra[0])]


def _resuming(run: Run, stage: str) -> bool:
    """Training continues from its latest saved state after an interruption (not part of the recorded command)."""
    state = run.dir / "state"
    return stage == "train" and state.is_dir() and any(state.glob("step-*"))


def _ckpt_verb(*verb: str, progress_flag: bool = True) -> Callable[[Run, list[str]], list[list[str]]]:
    def commands(run: Run, extra: list[str]) -> list[list[str]]:
        flags = _no_progress(run) if progress_flag else []
        return [[*verb, str(run.ckpt), *flags, *_args(e)] for e in extra]

    return commands


def _plan(run: Run, extra: list[str]) -> list[list[str]]:
    cmds = []
    for e in extra:
        argv = ["plan", str(run.ckpt), *_args(e)]
        if "--out" not in argv and "--fast-memory" in argv:
            budget = argv[argv.index("--fast-memory") + 1]
            argv += ["--out", "plan-" + budget.replace("%", "pct").replace(".", "_") + ".json"]
        cmds.append(argv)
    return cmds


def _export(run: Run, extra: list[str]) -> list[list[str]]:
    argv = ["push", str(run.ckpt), *_args(extra[0])]
    if "--repo-id" not in argv:  # no repository named: show what would be uploaded
        argv += ["--repo-id", f"local/{run.dir.name}", "--dry-run"]
    return [argv]


def _files(*names: str) -> Callable[[Run], list[Path]]:
    return lambda run: [run.ckpt / n for n in names]


def _plan_outputs(run: Run, cmds: list[list[str]]) -> list[Path]:
    return [run.ckpt / c[c.index("--out") + 1] for c in cmds if "--out" in c]


def _no_summary(ckpt: Path) -> str:
    return ""


STAGES = [
    Stage("convert", _convert, lambda run: [], lambda run, c: [run.converted / "model.safetensors"], _no_summary),
    Stage("train", _train, lambda run: [run.converted / "model.safetensors"], lambda run, c: [run.ckpt / "model.safetensors"], _no_summary),
    Stage("measure", _ckpt_verb("measure"), _files("model.safetensors"), lambda run, c: [run.ckpt / "sparsity.json"], summaries.measure),
    Stage("profile", _ckpt_verb("profile"), _files("model.safetensors"), lambda run, c: [run.ckpt / "profile.safetensors"], summaries.profile),
    Stage("predictors", _ckpt_verb("predictors", "train"), _files("model.safetensors"),
          lambda run, c: [run.ckpt / "predictors.safetensors"], summaries.predictors),
    Stage("predictors_calibrate", _ckpt_verb("predictors", "calibrate"), _files("model.safetensors", "predictors.safetensors"),
          lambda run, c: [run.ckpt / "predictors.json"], summaries.predictors_calibrate),
    Stage("predictors_eval", _ckpt_verb("predictors", "eval"), _files("model.safetensors", "predictors.safetensors"),
          lambda run, c: [run.ckpt / "predictors.json"], summaries.predictors_eval),
    Stage("plan", _plan, _files("profile.safetensors", "predictors.safetensors"), _plan_outputs, summaries.plan),
    Stage("eval", _ckpt_verb("eval"), _files("model.safetensors", "predictors.safetensors"), lambda run, c: [run.ckpt / "eval.json"], summaries.accuracy),
    Stage("scorecard", _ckpt_verb("scorecard"), _files("model.safetensors", "predictors.safetensors", "eval.json", "sparsity.json"),
          lambda run, c: [run.ckpt / "scorecard.json"], summaries.scorecard),
    Stage("export", _export, _files("model.safetensors", "predictors.safetensors", "scorecard.json"), lambda run, c: [], _no_summary),
]
STAGE_NAMES = [s.name for s in STAGES]


def stage_arguments(stages: dict) -> dict[str, list[str] | None]:
    """The recipe's `stages:` mapping -> per stage a list of argument strings (one per command) or None (left out)."""
    unknown = sorted(set(stages) - set(STAGE_NAMES))
    if unknown:
        raise SparseforgeError(f"recipe key 'stages' has unknown stage(s) {unknown}; stages are {', '.join(STAGE_NAMES)}")
    out = {}
    for name in STAGE_NAMES:
        value = stages.get(name, "")
        if value is False:
            out[name] = None
        elif value is None or isinstance(value, str):
            out[name] = [value or ""]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            out[name] = list(value)
        else:
            raise SparseforgeError(f"recipe stages.{name} must be a string of arguments, a list of such strings or false, got {value!r}")
        if name in ("convert", "train", "export") and out[name] is not None and len(out[name]) != 1:
            raise SparseforgeError(f"recipe stages.{name} runs one command; give one string of arguments, got {len(out[name])}")
        for text in out[name] or []:
            try:
                shlex.split(text)
            except ValueError as e:
                raise SparseforgeError(f"recipe stages.{name}: cannot split {text!r} into arguments ({e}); close its quotes") from None
    return out


def _parse(parser, stage: str, argv: list[str]):
    """A stage command's options, parsed as the `sparseforge` CLI would; a bad option is a one-line error naming it."""
    verb = " ".join(argv[:2] if argv[0] == "predictors" else argv[:1])
    try:
        return parser.parse_args(argv)
    except SparseforgeError as e:
        raise SparseforgeError(f"recipe stages.{stage}: {e} (in `sparseforge {shlex.join(argv)}`); fix the option, see "
                               f"`sparseforge {verb} --help`") from None


# ---------------------------------------------------------------- run record


def _fingerprint(paths: list[Path]) -> dict[str, list[int] | None]:
    out = {}
    for p in paths:
        st = p.stat() if p.exists() else None
        out[str(p)] = [st.st_size, st.st_mtime_ns] if st else None
    return out


def _recorded(cmds: list[list[str]]) -> list[list[str]]:
    """A stage's commands as far as its results go: with or without progress bars, the same stage."""
    return [[a for a in argv if a != "--no-progress"] for argv in cmds]


class Record:
    """OUTPUT_DIR/pipeline.json: per finished stage its commands, settings, input fingerprints and time."""

    def __init__(self, path: Path):
        self.path = path
        self.stages = {}
        if path.is_file():
            data = read_json(path, fix="delete it to re-run every stage")
            if data.get("format_version") != RUN_FORMAT_VERSION or not isinstance(data.get("stages"), dict):
                raise SparseforgeError(f"{path} has format_version {data.get('format_version')}; delete it to re-run every stage")
            self.stages = data["stages"]

    def up_to_date(self, name: str, cmds: list[list[str]], settings: str, inputs: list[Path], outputs: list[Path]) -> bool:
        rec = self.stages.get(name)
        return (rec is not None and _recorded(rec["commands"]) == _recorded(cmds) and rec["settings"] == settings
                and rec["inputs"] == _fingerprint(inputs) and all(p.exists() for p in outputs))

    def finish(self, name: str, cmds: list[list[str]], settings: str, inputs: list[Path], seconds: float) -> None:
        self.stages[name] = {"commands": cmds, "settings": settings, "inputs": _fingerprint(inputs), "seconds": round(seconds, 1),
                             "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"format_version": RUN_FORMAT_VERSION, "stages": self.stages}, indent=1))

    def forget(self, names: list[str]) -> None:
        for n in names:
            self.stages.pop(n, None)


# ---------------------------------------------------------------- driver


def _selected(only: str | None, redo: str | None) -> tuple[list[str], list[str]]:
    """(stages to consider, stages forced to run) from --only and --redo."""
    def names(text: str, flag: str) -> list[str]:
        out = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in out if n not in STAGE_NAMES]
        if bad:
            raise SparseforgeError(f"{flag} {text!r}: unknown stage(s) {bad}; stages are {', '.join(STAGE_NAMES)}")
        return out

    chosen = names(only, "--only") if only else list(STAGE_NAMES)
    forced = []
    if redo:
        first = min(STAGE_NAMES.index(n) for n in names(redo, "--redo"))
        forced = STAGE_NAMES[first:]  # a redone stage invalidates everything after it
    return chosen, forced


def run_pipeline(recipe_path: str, overrides: list[str] = (), only: str | None = None, redo: str | None = None,
                 dry_run: bool = False, progress: bool = True) -> tuple[list[dict], Path]:
    """Run (or with dry_run, list) the pipeline's stages; returns one row per stage for the summary table and
    the checkpoint directory."""
    from sparseforge.cli import build_parser, quiet_libraries
    from sparseforge.train.recipe import load_recipe

    recipe = load_recipe(recipe_path, list(overrides))
    run = Run(Path(recipe_path), recipe, list(overrides), progress)
    arguments = stage_arguments(recipe.stages)
    chosen, forced = _selected(only, redo)
    record = Record(run.dir / "pipeline.json")
    parser = build_parser(raise_errors=True)
    todo = [s for s in STAGES if s.name in chosen]
    skip = {s.name: "left out" if arguments[s.name] is None else "not needed" for s in todo
            if arguments[s.name] is None or (s.name == "convert" and run.starts_sparse)}
    cmds = {s.name: s.commands(run, arguments[s.name]) for s in todo if s.name not in skip}
    for name, argvs in cmds.items():  # every stage's options are checked before the first stage runs
        for argv in argvs:
            _parse(parser, name, argv)
    quiet_libraries()
    rows = []
    for i, stage in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {stage.name}"
        if stage.name in skip:
            rows.append({"stage": stage.name, "status": skip[stage.name], "seconds": None, "result": ""})
            _say(f"{tag}: left out by the recipe" if skip[stage.name] == "left out" else
                 f"{tag}: not needed, {run.recipe.model} is already a sparse checkpoint")
            continue
        settings = run.training_settings() if stage.name == "train" else ""
        inputs, outputs = stage.inputs(run), stage.outputs(run, cmds[stage.name])
        shown = " && ".join("sparseforge " + shlex.join(c) for c in cmds[stage.name])
        if stage.name not in forced and record.up_to_date(stage.name, cmds[stage.name], settings, inputs, outputs):
            rows.append({"stage": stage.name, "status": "up to date", "seconds": record.stages[stage.name]["seconds"], "result": stage.summary(run.ckpt)})
            _say(f"{tag}: up to date, skipped")
            continue
        if dry_run:
            rows.append({"stage": stage.name, "status": "would run", "seconds": None, "result": shown})
            _say(f"{tag}: would run {shown}")
            continue
        missing = [p for p in inputs if not p.exists()]
        if missing:
            raise SparseforgeError(f"stage {stage.name} needs {missing[0]}, which an earlier stage writes; run without --only, or run that stage first")
        if stage.name == "convert" and "train" in cmds:  # training follows: its data must be there before convert (train checks it too)
            from sparseforge.train.tokens import check_sources

            check_sources(recipe.sources, recipe.data_root)
        _say(f"{tag}: {shown}")
        record.forget(STAGE_NAMES[STAGE_NAMES.index(stage.name):])  # this stage and later ones are no longer finished
        start = time.perf_counter()
        for argv in cmds[stage.name]:
            options = _parse(parser, stage.name, argv + (["--resume"] if _resuming(run, stage.name) else []))
            if options.func(options):  # the verb's function, with the options the command line would give it
                raise SparseforgeError(f"stage {stage.name}: `sparseforge {shlex.join(argv)}` failed (see its output above)")
        gc.collect()  # stages share one process: free one stage's models before the next loads its own
        seconds = time.perf_counter() - start
        missing = [p for p in stage.outputs(run, cmds[stage.name]) if not p.exists()]
        if missing:
            raise SparseforgeError(f"stage {stage.name} finished without writing {missing[0]} (see its output above)")
        record.finish(stage.name, cmds[stage.name], settings, stage.inputs(run), seconds)
        rows.append({"stage": stage.name, "status": "ran", "seconds": round(seconds, 1), "result": stage.summary(run.ckpt)})
        _say(f"{tag}: done in {seconds:.0f} s" + (f" ({rows[-1]['result']})" if rows[-1]["result"] else ""))
    return rows, run.ckpt


def _say(line: str) -> None:
    print(line, flush=True)


def format_summary(rows: list[dict]) -> str:
    """The final table: stage, status, time, one-line result."""
    lines = ["| stage | status | seconds | result |", "| --- | --- | ---: | --- |"]
    for r in rows:
        secs = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {r['stage']} | {r['status']} | {secs} | {r['result']} |")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="the whole pipeline from a recipe: convert, train, profile, predictors, plan, eval, scorecard, export",
        description="Run every stage of a recipe (recipes/*.yaml) into its output_dir, skipping stages whose outputs are up "
        "to date and resuming an interrupted run. Each stage is one `sparseforge` command, printed before it runs; the "
        "recipe's `stages:` mapping holds their extra arguments. The result is OUTPUT_DIR/checkpoint.",
    )
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/smollm2-135m-quickstart.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, value parsed as YAML (repeatable), e.g. --set max_steps=20 or --set stages.eval='--limit 50'")
    p.add_argument("--only", default=None, metavar="STAGES", help=f"comma-separated stages to consider (others untouched): {', '.join(STAGE_NAMES)}")
    p.add_argument("--redo", default=None, metavar="STAGES", help="run these stages and every later one even when up to date")
    p.add_argument("--dry-run", action="store_true", help="print each stage's status and command without running anything")
    p.add_argument("--no-progress", action="store_true", help="no progress bars inside the stages")
    p.set_defaults(func=run_command)


def run_command(args) -> int:
    rows, ckpt = run_pipeline(args.recipe, args.overrides, args.only, args.redo, args.dry_run, not args.no_progress)
    if args.dry_run:
        return 0
    print()
    print(format_summary(rows))
    scorecard = ckpt / "scorecard.json"
    if scorecard.is_file():
        from sparseforge.eval.scorecard import markdown

        print()
        print(markdown(read_json(scorecard)))
    return 0
