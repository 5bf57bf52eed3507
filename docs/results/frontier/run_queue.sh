#!/usr/bin/env bash
# Generate every cell of the frontier queue into docs/results/cache, one cell per process
# (so new code and a reordered queue are picked up between cells). Optional $1: a pid to
# wait for first (a generation already running). Log: stdout.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=$PWD WORLDCUP_DATA_DIR=${WORLDCUP_DATA_DIR:-$(cd .. && pwd)/shared/data}
# On shared, busy cores a multi-threaded forward waits for its descheduled threads at
# every parallel region: one thread per worker, and several workers share the queue
# (each claims a cell, see worldcup_eval/gen_queue.py).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
PY=${PY:-.venv/bin/python}
if [ -n "$1" ]; then while kill -0 "$1" 2>/dev/null; do sleep 5; done; fi
while true; do
  "$PY" -m worldcup_eval.gen_queue docs/results/frontier/queue.txt --config docs/results/frontier/frontier.toml
  rc=$?
  [ $rc -eq 3 ] && break
  [ $rc -ne 0 ] && sleep 20
done
