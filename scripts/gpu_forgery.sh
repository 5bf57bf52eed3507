#!/usr/bin/env bash
# Issue #45's attack at real budgets on a lent GPU: the three scenarios of
# `python -m worldcup_eval.forgery` side by side, each within a time limit, everything
# they wrote packed for the trip back. The runs resume, so what a GPU did not finish a
# CPU finishes from the same folders (unpack, then rerun the same forgery command).
#
#   bash scripts/gpu_forgery.sh [--bundle DIR] [--data DIR] [--out DIR] [--budget N]
#                               [--seconds S] [--device cuda] [--batch B] [--small]
#
# The GPU host lacks the model and the service's wheels: it takes the bundle
# `make gpu-bundle` builds (carried in loads, as for scripts/gpu_service_check.sh) and the
# evaluation data copied into an ignored folder of the checkout (--data; `../shared`
# does not travel). What comes back in --out: forgery.tar.xz cut in parts of 15 MiB
# (forgery.tar.xz.partNN) and forgery.sha256; reassemble with
# `cat forgery.tar.xz.part* | sha256sum -c`-checked, then `tar -xJf -`.
# --small: tiny spoof and control counts, to check the script itself on the CPU before a
# lease (`PYTHON=.venv/bin/python bash scripts/gpu_forgery.sh --small --device cpu
# --budget 400 --batch 8 --seconds 400`: about 4 minutes on 2 cores); the harness
# itself is tested in tests/test_forgery.py.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bundle="$here/gpu-bundle"
data="$here/.forgery-data"
out="${OUT:-$here/gpu-forgery-out}"
budget=200000
seconds=330
device=cuda
batch=192
small=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$2; shift ;;
    --data) data=$2; shift ;;
    --out) out=$2; shift ;;
    --budget) budget=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --device) device=$2; shift ;;
    --batch) batch=$2; shift ;;
    --small) small=1 ;;
    *) echo "gpu_forgery: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-forgery.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
if [ "$small" = 1 ]; then
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
  sizes=(--spoof-prompts 2 --best-of 2 --piggyback 2 --human-texts 12)
else
  bash "$here/scripts/gpu_bundle_install.sh" "$py" "$bundle" "$work"
  # the checkout's code first (it may be newer than the bundle's wheel), the wheels' deps next
  export PYTHONPATH="$here:$work/site${PYTHONPATH:+:$PYTHONPATH}"
  sizes=(--spoof-prompts 80 --best-of 2 --piggyback 20)
fi
export PYTHONUNBUFFERED=1
runs="$work/forgery"
mkdir -p "$runs"
pids=()
for scenario in per-request fixed kgw; do
  # SIGINT at the limit: the runs append each finished row, so a cut run loses one row
  timeout --signal=INT --kill-after=20 "$seconds" "$py" -m worldcup_eval.forgery \
    --scenario "$scenario" --budget-tokens "$budget" --out "$runs/$scenario" \
    --device "$device" --batch-size "$batch" --data-dir "$data" --threads 4 "${sizes[@]}" \
    > "$runs/$scenario.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$((status + 1)); done
echo "gpu_forgery: $status of 3 runs stopped early (limit or error; see their logs)" >&2
for scenario in per-request fixed kgw; do
  tail -n 3 "$runs/$scenario.log" | sed "s/^/[$scenario] /" >&2
  wc -l "$runs/$scenario"/*.jsonl 2>/dev/null | sed "s/^/[$scenario] /" >&2 || true
done
tar -C "$work" -cf - forgery | xz -T0 -3 > "$work/forgery.tar.xz"
split -b 15M -d -a 2 "$work/forgery.tar.xz" "$out/forgery.tar.xz.part"
(cd "$work" && sha256sum forgery.tar.xz) > "$out/forgery.sha256"
ls -la "$out" >&2
