#!/usr/bin/env bash
# pytest exits 5 when it collected nothing: that is a broken suite, never green.
set -uo pipefail
cd "$(dirname "$0")/.."
"${WORLDCUP_VENV:-.venv}"/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): failing on purpose" >&2
  exit 1
fi
exit "$rc"
