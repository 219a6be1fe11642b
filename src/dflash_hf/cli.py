"""`dflash-hf` command line: generate | bench | convert | train | corpus | prune-vocab | average | upload | demo.

Each subcommand lives in the module that does the work and registers itself through `add_parser(subparsers)`;
this file only collects them.
"""

import argparse
import importlib
import sys

# module -> subcommand(s) it registers; a module that is not there yet simply adds nothing.
SUBCOMMAND_MODULES = ("dflash_hf.generate_cli", "dflash_hf.formats", "dflash_hf.bench", "dflash_hf.training.cli",
                      "dflash_hf.training.corpus_cli", "dflash_hf.training.vocab", "dflash_hf.training.average",
                      "dflash_hf.hub_upload", "dflash_hf.demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-hf", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or not name.startswith(error.name):
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
