#!/usr/bin/env bash
# Generate every missing cell (and paraphrase) of the comparison into docs/results/cache,
# one per process, so new code and an edited compare.toml are picked up between cells.
# Optional $1: a pid to wait for first (a generation already running). Log: stdout.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=$PWD WORLDCUP_DATA_DIR=${WORLDCUP_DATA_DIR:-$(cd .. && pwd)/shared/data}
# one thread: on shared, busy cores a multi-threaded forward waits for descheduled threads
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
PY=${PY:-.venv/bin/python}
if [ -n "$1" ]; then while kill -0 "$1" 2>/dev/null; do sleep 5; done; fi
while true; do
  "$PY" -m worldcup_eval.compare --generate
  rc=$?
  [ $rc -eq 3 ] && break
  [ $rc -ne 0 ] && sleep 20
done
