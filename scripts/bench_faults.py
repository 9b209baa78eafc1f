"""The fault suite as a benchmark: each kind of fault over seeded trials of real 4-rank gloo
jobs, injected from outside the program (``scripts/faults``), named or not by commviz's own
live path (``commviz watch``'s windows, 1 s each); prints per kind right, wrong, missed, false
names, the detection latency in windows after the onset, precision and recall.

    python scripts/bench_faults.py [--trials 10] [--kinds late,link,...] [--findings FILE]

Needs root (network namespaces, tc, cgroup v1 ``cpu``). Target: precision and recall >= 0.95
per kind, named within 2 windows of the onset, nobody named where no fault is planted.
``--findings FILE``: append, per kind that missed its target, the evidence (seeds, the
planted fault, what was named, one trial's windows as JSON) for whoever fixes the detector.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import trial  # noqa: E402
from faults.inject import can_inject  # noqa: E402
from faults.trial import Outcome, Result  # noqa: E402

HEAD = ("kind", "fault", "trials", "right", "wrong", "missed", "false names",
        "latency (windows: median, max)", "precision", "recall")


def row(kind: trial.Kind, results: list[Result]) -> tuple[str, ...]:
    n = Counter(r.outcome for r in results)
    if kind.cause is None:
        return (kind.name, kind.what, str(len(results)), "-", "-", "-", str(n[Outcome.FALSE]),
                "-", "-", "-")
    lat = [r.latency for r in results if r.outcome is Outcome.RIGHT]
    named = n[Outcome.RIGHT] + n[Outcome.WRONG] + n[Outcome.FALSE]
    return (kind.name, kind.what, str(len(results)), str(n[Outcome.RIGHT]),
            str(n[Outcome.WRONG]), str(n[Outcome.MISSED]), str(n[Outcome.FALSE]),
            f"{statistics.median(lat):g}, {max(lat)}" if lat else "-",
            f"{n[Outcome.RIGHT] / named:.2f}" if named else "-",
            f"{n[Outcome.RIGHT] / len(results):.2f}")


def table(rows: list[tuple[str, ...]]) -> str:
    lines = [HEAD, tuple("---" for _ in HEAD), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _short(name: trial.Name) -> str:
    who = f"{name.who[0]}->{name.who[1]}" if isinstance(name.who, tuple) else f"rank {name.who}"
    return f"{who} ({name.cause})"


def evidence(kind: trial.Kind, results: list[Result]) -> str | None:
    """The findings entry of a kind that missed its target (None: it met it)."""
    bad = [r for r in results if r.outcome not in (Outcome.RIGHT, Outcome.CLEAN)]
    if not bad:
        return None
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {now}: fault kind `{kind.name}` ({kind.what}): {len(bad)} of "
             f"{len(results)} trials not right", ""]
    expect = (f"expected: {_short(bad[0].plan.expected)} named within {trial.DEADLINE} windows "
              "of the onset, nobody else" if kind.cause else "expected: nobody named")
    lines += [expect, ""]
    for r in bad:
        named = r.wrong_names + r.false_names
        lines.append(f"- seed {r.plan.seed}: planted rank {r.plan.rank}, onset in window "
                     f"{r.onset_window}; {r.outcome.value}: "
                     f"{', '.join(sorted(set(map(_short, named)))) or 'nobody named'}")
    first = bad[0]
    lines += ["", f"seed {first.plan.seed}, every window's `stragglers` (onset in window "
              f"{first.onset_window}):", "", "```"]
    lines += [f"{i}: {orjson.dumps(w['stragglers']).decode()}" for i, w in
              enumerate(first.windows)]
    shown = first.onset_window if first.bad_window is None else first.bad_window
    lines += ["```", "", f"seed {first.plan.seed}, window {shown} (the "
              + ("onset's" if first.bad_window is None else "first to name wrongly")
              + ") as `commviz watch --format json` gives it:", "", "```json"]
    lines += [orjson.dumps(first.windows[shown or 0]).decode(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--kinds", default=",".join(trial.KINDS),
                   help=f"comma-separated, of {', '.join(trial.KINDS)}")
    p.add_argument("--findings", type=Path, help="append what missed its target here")
    p.add_argument("--keep", type=Path, help="keep every trial's run dir under this dir")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # clean up as on Ctrl-C
    why = can_inject()
    if why:
        sys.exit(f"bench_faults: cannot inject faults here: {why}")
    kinds = [trial.KINDS[k] for k in a.kinds.split(",")]
    began = time.monotonic()
    rows, failed_injections = [], 0
    with trial.Launcher() as launcher, tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            results = []
            for seed in range(a.seed, a.seed + a.trials):
                run_dir = (a.keep or Path(tmp)) / f"{kind.name}-{seed}"
                t = time.monotonic()
                res = trial.run(launcher, kind.name, seed, run_dir)
                results.append(res)
                named = sorted(set(map(_short, res.wrong_names + res.false_names)))
                print(f"[{time.monotonic() - began:6.0f} s] {kind.name} seed {seed}: rank "
                      f"{res.plan.rank}, {res.outcome.value}"
                      + (f" in {res.latency}" if res.latency is not None else "")
                      + (f"; named {', '.join(named)}" if named else "")
                      + ("" if res.injected else "; THE FAULT DID NOT TAKE HOLD")
                      + f" ({time.monotonic() - t:.1f} s)", flush=True)
                failed_injections += not res.injected
                if a.keep is None:
                    shutil.rmtree(run_dir, ignore_errors=True)
            rows.append(row(kind, results))
            found = evidence(kind, results)
            if found and a.findings:
                with a.findings.open("a") as f:
                    f.write(found + "\n")
    print()
    print(table(rows))
    print(f"\n{sum(int(r[2]) for r in rows)} trials in {time.monotonic() - began:.0f} s; "
          f"windows of {trial.WINDOW_S:g} s; {failed_injections} trial(s) whose fault did not "
          "take hold")


if __name__ == "__main__":
    main()
