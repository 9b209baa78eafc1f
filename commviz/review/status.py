"""``commviz status RUN_DIR``: the verdict on a job that is still running, from another shell.

Every rank of the run dir on this host is asked for its stacks without stopping it
(``commviz.record.stacks.LIVE_SIGNAL``); the verdict is then built from the ranks' journals
and those stacks (``commviz.review.verdict``). Exit status 0 when the ranks agree (nothing
held up yet), 1 with a verdict, 2 when the run dir cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from commviz.record import stacks
from commviz.review.verdict import build_verdict


def handler(args: argparse.Namespace) -> int:
    asked = stacks.request_all(args.run_dir, args.wait)
    verdict = build_verdict(args.run_dir, live=True)
    sys.stdout.write(f"commviz status: {args.run_dir}: stacks asked of ranks "
                     f"{asked or 'none (no rank of it runs on this host)'}\n")
    if verdict is None:
        sys.stdout.write("no rank is held up: every collective begun was completed by its "
                         "group, or is still being joined\n")
        return 0
    sys.stdout.write(verdict.render())
    return 1


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("While a job runs: ask its ranks for their stacks (they go on) and say "
                     "which rank holds the others up, where it is, and what the others wait in.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir the job records into")
    p.add_argument("--wait", type=float, default=1.0, metavar="S",
                   help="seconds to give the ranks to write their stacks (default 1)")
    p.set_defaults(func=handler)
