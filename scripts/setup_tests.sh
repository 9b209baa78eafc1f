#!/usr/bin/env bash
# What the tests need beyond commviz and its test extras (scripts/setup.sh), run by
# scripts/test.sh: the frameworks whose own code the tests run under commviz, and Debian's
# Prometheus server. Idempotent: when everything is there it only compares versions.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 \
  | grep -v -e "is ignored: it is neither a file nor a directory" || true; }
pinned() {  # NAME==VERSION ...: are exactly these installed?
  .venv/bin/python -c "
import sys
from importlib.metadata import version
sys.exit(any(version(p) != v for p, v in (a.split('==') for a in sys.argv[1:])))
" "$@" 2>/dev/null
}
# torchtitan, whose own Trainer tests/test_torchtitan.py runs: with --no-deps (its requirements
# would bring wandb and more) and only what its Trainer imports, pinned as tested; torch stays
# the build above. About 300 MB (triton) and 30 s once; a look at the versions when present.
TITAN="torchtitan==0.3.0 spmd_types==0.2.3 triton==3.9.0"
TITAN_DEPS="tyro==1.0.17 torchdata==0.11.0 tokenizers==0.23.3 tensorboard==2.21.0 datasets==4.7.0"
if ! pinned $TITAN $TITAN_DEPS; then
  pip install --no-deps $TITAN
  pip install $TITAN_DEPS "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi
# DeepSpeed, whose engine and ZeRO optimizers tests/test_framework_deepspeed.py runs on CPU:
# with --no-deps (its requirements name torch) and only the packages it imports, pinned as
# tested; DS_BUILD_OPS=0 builds none of its C++ ops at install. The CPU accelerator's
# shared-memory comm op, which DeepSpeed builds at every job's init_distributed until it is
# cached (about 1 min of CPU), is built here once instead.
DS="deepspeed==0.19.8 hjson==3.1.0 msgpack==1.2.4 einops==0.8.2 tqdm==4.70.1"
if ! pinned $DS; then
  DS_BUILD_OPS=0 pip install --no-deps $DS
fi
DS_ACCELERATOR=cpu .venv/bin/python -c "
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)" >/dev/null 2>&1 \
  || echo "deepspeed: its CPU comm op not built; tests/test_framework_deepspeed.py builds it"
# Megatron-core, whose GPTModel, schedules, DDP and optimizer tests/test_framework_megatron.py
# runs on CPU: with --no-deps (Transformer Engine and Apex are optional; it imports torch,
# numpy and packaging, which are here). 0.16.1 is the newest built for Python 3.11.
MCORE="megatron-core==0.16.1"
if ! pinned $MCORE; then
  pip install --no-deps $MCORE
fi
# Debian packages the tests start for real, where they are missing and we may install them (as
# root with apt-get). Their services must not start (a container's policy-rc.d already says so;
# elsewhere one is put in place for the install only): the tests run their own.
debian_install() {  # PACKAGE...: install quietly; non-zero when apt-get failed
  local made_policy= status=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "$@"; } >/dev/null 2>&1 || status=1
  if [ -n "$made_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
  return $status
}
can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
# The Prometheus server tests/test_prometheus.py scrapes a live job with (Debian's package): the
# tests run it on a scratch config, port and data dir.
if ! command -v prometheus >/dev/null && can_install; then
  debian_install prometheus \
    || echo "prometheus: not installed (apt-get failed); tests/test_prometheus.py will skip"
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
# Debian's chromium, the browser tests/test_serve.py loads commviz serve's pages in (through
# Playwright, pointed at /usr/bin/chromium: a browser download fails here), and its driver for
# Selenium users.
if ! command -v chromium >/dev/null && can_install; then
  debian_install chromium chromium-driver \
    || echo "chromium: not installed (apt-get failed); tests/test_serve.py will skip"
fi
