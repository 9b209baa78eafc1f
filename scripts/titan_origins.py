"""What the origins of a torchtitan run read, per run dir: ``python scripts/titan_origins.py RUN_DIR ...``

One JSON row per run: records, records per origin kind, the ten commonest origins, and the
counts that must be 0 for torchtitan's units to be named as its users know them: records
without an origin, DTensor records without a unit, unit names with a wrapper's name in them
(``_checkpoint_wrapped_module``, ``_orig_mod``, ``_fsdp_wrapped_module``), and pipeline
"shape inference" records outside the first step a rank ran (shape inference happens once).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from commviz import metadata as md  # noqa: E402
from commviz.trace.run import load_run  # noqa: E402

WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def summary(run_dir: Path) -> dict:
    run = load_run(run_dir)
    records = [r for item in run.ranks.values() if item.record is not None
               for r in item.record["collectives"]]
    origins = Counter(str(r.get(md.ORIGIN)) for r in records)
    kinds = Counter(str(r.get(md.ORIGIN_KIND)) for r in records)
    return {
        "run": run_dir.name,
        "records": len(records),
        "kinds": dict(kinds),
        "top_origins": origins.most_common(10),
        "no_origin": sum(not r.get(md.ORIGIN) for r in records),
        "dtensor_no_unit": sum(r.get(md.ORIGIN_KIND) == md.OriginKind.DTENSOR and not r.get(md.ORIGIN_UNIT)
                               for r in records),
        "wrapper_names": sum(any(w in str(r.get(md.ORIGIN, "")) for w in WRAPPERS)
                             for r in records),
        "shape_inference": sum("shape inference" in str(r.get(md.ORIGIN, "")) for r in records),
    }


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        try:
            print(json.dumps(summary(Path(arg))), flush=True)
        except Exception as exc:  # a run that left nothing: its row says why
            print(json.dumps({"run": Path(arg).name, "error": f"{type(exc).__name__}: {exc}"}))
