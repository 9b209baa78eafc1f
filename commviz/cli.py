"""The ``commviz`` command line: launch, merge, annotate, verify, report.

Each subcommand lives beside the code it drives, in a module with ``register(subparsers)``
that adds its parser and sets ``func``; this file only puts them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from commviz.errors import WRITE_ERRNOS, CommvizError, cannot_write

# (module, what it adds) in the order ``commviz --help`` lists them.
COMMANDS = (
    "commviz.launch.command",     # commviz launch CONFIG.yaml
    "commviz.merge.command",      # commviz merge RUN_DIR
    "commviz.merge.annotate",     # commviz annotate TRACE RECORD -o OUT
    "commviz.verify.command",     # commviz verify OUT.pftrace
    "commviz.review.command",     # commviz report RUN_DIR
    "commviz.review.overview",    # commviz overview RUN_DIR
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commviz",
        description="Make collective communication visible in multi-GPU PyTorch jobs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:           # a missing module is an error, never a dropped command
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommvizError as exc:
        print(f"commviz {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:       # a full or read-only disk, wherever a command writes
        if exc.errno not in WRITE_ERRNOS:
            raise
        print(f"commviz {args.command}: error: {cannot_write(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"commviz {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
