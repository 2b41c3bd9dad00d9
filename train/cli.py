"""CLI of the train stage: `sparseforge train` and `python -m sparseforge.train` (what accelerate launches)."""

import argparse
import sys

from sparseforge.cli_options import add_recipe_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_options(p)
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its latest saved state")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="save the state and stop at this step (continue later with --resume)")
    p.add_argument("--tokenize-only", action="store_true",
                   help="build the recipe's token stores of file and Hub sources (tokenizer only, no model) and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="continued pretraining of a converted model (run under `accelerate launch` for multi-device)",
        description="Continued pretraining from a recipe. Single process: `sparseforge train --config R.yaml`; "
        "any accelerate setup: `accelerate launch --config_file recipes/accelerate/X.yaml -m sparseforge.train --config R.yaml`.",
    )
    add_arguments(p)
    p.set_defaults(func=train_command)


def train_command(args) -> int:
    from sparseforge.train.loop import train
    from sparseforge.train.recipe import load_recipe

    recipe = load_recipe(args.config, args.overrides)
    if args.tokenize_only:
        from sparseforge.train.mixture import tokenize_sources

        for name, store in tokenize_sources(recipe, progress=not args.no_progress).items():
            print(f"{name}: {store.meta['train_tokens']:,} training + {store.meta['val_tokens']:,} held-out tokens in {store.path}")
        return 0
    checkpoint = train(recipe, resume=args.resume, progress=not args.no_progress, stop_after=args.stop_after)
    if checkpoint is not None:
        print(f"wrote {checkpoint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from sparseforge.cli import run_command

    parser = argparse.ArgumentParser(prog="python -m sparseforge.train", description="Continued pretraining from a recipe.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = "train"
    return run_command(train_command, args)


if __name__ == "__main__":
    sys.exit(main())
