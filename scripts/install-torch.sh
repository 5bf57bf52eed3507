#!/usr/bin/env bash
# Install torch 2.13.0 into a venv: the CPU build unless this machine has an NVIDIA driver.
#
#   bash scripts/install-torch.sh .venv
#
# PyPI's Linux torch is the CUDA build (several GB of nvidia-* wheels), so on a machine
# without an NVIDIA driver torch comes from PyTorch's CPU index. Where that index cannot
# be reached (a mirror, an offline machine with a local wheel folder), the CPU build is
# asked for by its exact version, torch==2.13.0+cpu, from whatever pip is configured with:
# it is found there or the install fails; a CUDA build is never pulled instead.
# Machines with an NVIDIA driver get PyPI's default (CUDA) build.
# WORLDCUP_TORCH_INDEX=<url> picks the index yourself (e.g. .../whl/cu126).
# WORLDCUP_TORCH_DRY_RUN=1 prints the pip arguments instead of running pip (tests).
set -euo pipefail
venv=$1
version=2.13.0
cpu_index=${WORLDCUP_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
driver=${WORLDCUP_NVIDIA_DRIVER_FILE:-/proc/driver/nvidia/version}

if [ -n "${WORLDCUP_TORCH_INDEX:-}" ]; then
  args=(--index-url "$WORLDCUP_TORCH_INDEX" "torch==$version")
  why="WORLDCUP_TORCH_INDEX"
elif [ -e "$driver" ] || command -v nvidia-smi > /dev/null 2>&1; then
  args=("torch==$version")
  why="NVIDIA driver found: PyPI's CUDA build"
elif python3 - "$cpu_index/torch/" << 'EOF'; then
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10).close()
except Exception:
    sys.exit(1)
EOF
  args=(--index-url "$cpu_index" "torch==$version")
  why="no NVIDIA driver: the CPU build from $cpu_index"
else
  args=("torch==$version+cpu")
  why="no NVIDIA driver, $cpu_index unreachable: the CPU build from pip's own configuration"
fi
echo "install-torch: $why" >&2
if [ "${WORLDCUP_TORCH_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${args[@]}"
  exit 0
fi
"$venv/bin/python" -m pip install --quiet "${args[@]}"
