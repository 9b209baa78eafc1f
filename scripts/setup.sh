#!/usr/bin/env bash
# Set up commviz on a fresh machine: a virtualenv in .venv with the CPU build of torch 2.13.0
# (the build this machine kind installs from a local file; a looser pin would pull a multi-GB
# CUDA build) and commviz itself, editable, with its test extras. Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 \
  | grep -v -e "is ignored: it is neither a file nor a directory" || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install "torch==2.13.0"
fi
if ! .venv/bin/python -c "import commviz, perfetto, yaml, pydantic, rich, orjson, msgspec, matplotlib, pytest, pytest_timeout, xdist, psutil, hta, prometheus_client" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.commviz-installed ] \
   || [ -n "$(find commviz -name '*.c' -newer .venv/.commviz-installed 2>/dev/null)" ]; then
  pip install -e ".[test]"
  touch .venv/.commviz-installed
fi
.venv/bin/python -c "import torch, commviz; print(f'commviz {commviz.__version__} ready: torch {torch.__version__}, .venv/bin/commviz')"
# Build commviz's c10d boundary kernel now (about 20 s once; cached in torch's extension dir)
# rather than at a job's first collective.
.venv/bin/python -c "
from commviz.record import boundary
problem = boundary.prebuild()
print('c10d boundary kernel: ' + ('built' if problem is None else 'NOT built: ' + problem))"
