#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. GPU tests skip without CUDA GPUs.
# pytest's exit code 5 ("no tests collected") is turned into a failure, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
