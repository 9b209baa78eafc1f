"""``commviz status RUN_DIR``: the verdict on a job that is still running, from another shell.

Every rank is asked for its stacks without stopping it (``review.analyses.asked``), then judged
from its journal and those stacks (``review.analyses.judge``). Exit status 0 when the ranks
agree (nothing held up yet, or nothing recorded yet), 1 with a verdict, 2 when the run dir
cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from commviz.review.analyses.asked import DEFAULT_WAIT_S, ask_every_rank
from commviz.review.front import Run
from commviz.review.render.asked_text import asked_text
from commviz.review.render.verdict_text import verdict_text


def run(args: argparse.Namespace) -> int:
    job = Run(args.run_dir)
    asked = ask_every_rank(job.run_dir, job.files, args.wait)
    verdict = job.verdict(live=True)
    sys.stdout.write(asked_text(asked, job.run_dir))
    if verdict is None and not any(ri.record is not None for ri in job.files.ranks.values()):
        sys.stdout.write("no rank records yet: nothing to judge\n")
        return 0
    if verdict is None:
        sys.stdout.write("no rank is held up: every collective begun was completed by its "
                         "group, or is still being joined\n")
        return 0
    sys.stdout.write(verdict_text(verdict))
    return 1


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("While a job runs: ask its ranks, on every node, for their stacks (they go "
                     "on) and say which rank holds the others up, where it is, and what the "
                     "others wait in.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir the job records into")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                   help="at most how long to wait for the ranks' stacks and the other nodes' "
                        f"answers (default {DEFAULT_WAIT_S:g})")
    p.set_defaults(func=run)
