"""The ``commviz`` command line: launch, merge, annotate, verify, report, status, overview,
preview, watch, diff, exporter, serve.

Each subcommand lives beside the code it drives, in a module with ``register(parser)`` that
adds its arguments and description and sets ``func`` to the module's ``run(args)`` (its exit
status); this file only puts them together. Only
the module of the command being run is imported (``commviz --help`` imports none of them), so
every command starts without loading the others' dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from commviz.errors import WRITE_ERRNOS, CommvizError, cannot_write


class Command(NamedTuple):
    name: str
    module: str         # the module whose register(parser) fills the command's parser
    help: str           # the line ``commviz --help`` shows


COMMANDS = (
    Command("launch", "commviz.launch.launch_command",
            "run a YAML-configured experiment through torchrun and merge its trace"),
    Command("merge", "commviz.merge.command",
            "merge every rank's profiler trace and record into one trace"),
    Command("annotate", "commviz.merge.annotate",
            "attach a rank's recorded collective metadata to its profiler trace"),
    Command("verify", "commviz.verify.verify_command",
            "check a .pftrace as Perfetto will read it (and against its inputs)"),
    Command("report", "commviz.review.commands.report",
            "skew, stragglers, bandwidth, desyncs and streams of a run"),
    Command("status", "commviz.review.commands.status",
            "while a job runs: which rank holds the others up, and where (stacks taken live)"),
    Command("overview", "commviz.review.overview",
            "one small trace of every rank's collectives, from the comm tables"),
    Command("preview", "commviz.review.commands.preview",
            "draw a merged trace as a PNG timeline (ranks, comm lanes, cross-rank links)"),
    Command("watch", "commviz.live.watch",
            "while a job runs: per group and origin, skew, wait, bandwidth; the late rank named"),
    Command("diff", "commviz.review.diffout",
            "what changed between two runs, per origin: transfer time or waiting, and for whom"),
    Command("exporter", "commviz.live.exporter",
            "while a job runs: its collectives as Prometheus metrics on /metrics"),
    Command("serve", "commviz.serve.server",
            "the run in a browser: live while the job runs, the report, timeline and trace after"),
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: the command it names gets its full parser (its module is
    imported; a missing one is an error, never a dropped command), the others their name and
    help line only."""
    parser = argparse.ArgumentParser(
        prog="commviz",
        description="Make collective communication visible in multi-GPU PyTorch jobs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv)
                   if not a.startswith("-")), None)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.name == chosen:
            importlib.import_module(command.module).register(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
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
