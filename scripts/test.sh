#!/usr/bin/env bash
# Set up (scripts/setup.sh, then scripts/setup_tests.sh) and run the whole test suite. GPU tests
# skip without CUDA GPUs.
# Two workers (COMMVIZ_TEST_WORKERS), a whole test file to each, so a module's shared jobs run
# once: on 2 cores the suite takes 10-18 min this way, by machine. It is CPU-bound (90 % of its
# CPU in the jobs' processes, each of which spends about 1 s importing torch): a third worker
# gains 4 %.
# pytest's exit code 5 ("no tests collected") is turned into a failure, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh && bash scripts/setup_tests.sh || exit 1
.venv/bin/python -m pytest -n "${COMMVIZ_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
