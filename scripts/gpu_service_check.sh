#!/usr/bin/env bash
# The service on a GPU, end to end, on a bare CUDA host with no network: one command.
#
#   bash scripts/gpu_service_check.sh [--bundle DIR] [--out DIR]   # on the GPU host
#   bash scripts/gpu_service_check.sh --dry-run [--out DIR]        # here, on the CPU
#
# The host has python3 with CUDA PyTorch (and Triton, transformers, numba, scipy); what it
# lacks ships beside this script as the bundle `make gpu-bundle` builds (gpu-bundle/:
# the project's wheel, the service's missing dependencies as cp312 manylinux wheels, the
# embedded SmolLM2 GGUF; every file in parts of at most 64 MiB, grouped in load-N/
# folders of at most 27 MiB, each file's sha256 in manifest.json; never committed).
# The flow (scripts/gpu_service_check.py has the Python half):
#   1. verify: reassemble every file from its parts, check size and sha256 (fatal, named);
#   2. install: the wheels, --no-deps, into a private target (the host's torch untouched);
#      the GGUF where the service finds the embedded model;
#   3. drive: `worldcup serve` on CUDA with the HF engine and the embedded model, and a
#      plain baseline arm; 1, 16 and 64 concurrent /generate requests, watermarked and
#      not, interleaved: tokens/s and their ratio, each text's decode; then the fused
#      step alone, eager and under a CUDA graph, at batch 1/64/256. report.json and
#      report.md land in --out ($OUT on the device tool), the tables docs/benchmarks.md
#      takes.
# --dry-run does all of it on the CPU, from a bundle built here offline (the project
# wheel and the model, in small parts so that reassembly is exercised), at 1/2/4
# concurrent requests of 8 tokens; `make test` runs it (tests/test_gpu_service_check.py).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dry=0
bundle="$here/gpu-bundle"
out="${OUT:-$here/gpu-check-out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --bundle) bundle=$2; shift ;;
    --out) out=$2; shift ;;
    *) echo "gpu_service_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ "$dry" = 1 ]; then
  py=${PYTHON:-$here/.venv/bin/python}
  bundle="$work/bundle"
  # small parts and loads: the reassembly and the manifest are what the dry run checks
  "$py" "$here/scripts/gpu_service_check.py" build --offline --out "$bundle" --part-mib 16 --load-mib 40
  device=cpu
  drive=(--levels 1 2 4 --tokens 8 --rounds 2 --step-batches 1 4 --repeats 5 --dry-run)
else
  py=${PYTHON:-python3}
  device=cuda
  drive=()
  "$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
fi
bash "$here/scripts/gpu_bundle_install.sh" "$py" "$bundle" "$work"
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$work"  # not the checkout: the installed wheel is what runs
timeout 480 "$py" "$here/scripts/gpu_service_check.py" drive --device "$device" --out "$out" "${drive[@]}"
