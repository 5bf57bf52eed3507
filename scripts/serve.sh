#!/usr/bin/env bash
# Run the service on the embedded defaults: SmolLM2, SQLite store, and local
# secrets generated once under .cache/secrets (mode 600). Settings from the
# environment or .env still win (e.g. WORLDCUP_REDIS_URL=redis://127.0.0.1:6379/0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WORLDCUP_VENV:-.venv}  # .venv-vllm for WORLDCUP_ENGINE=vllm (make run ENGINE=vllm)
dir=.cache/secrets
mkdir -p "$dir" && chmod 700 "$dir"
umask 077
[ -s "$dir/master_key.hex" ] || "$VENV"/bin/python -c "import secrets; print(secrets.token_hex(32))" > "$dir/master_key.hex"
[ -s "$dir/admin_token" ] || "$VENV"/bin/python -c "import secrets; print('adm_' + secrets.token_urlsafe(32))" > "$dir/admin_token"
export WORLDCUP_MASTER_KEY_FILE="${WORLDCUP_MASTER_KEY_FILE:-$PWD/$dir/master_key.hex}"
export WORLDCUP_ADMIN_TOKEN_FILE="${WORLDCUP_ADMIN_TOKEN_FILE:-$PWD/$dir/admin_token}"
export WORLDCUP_SQLITE_PATH="${WORLDCUP_SQLITE_PATH:-$PWD/.cache/worldcup.sqlite3}"
# the server prints "listening on http://HOST:PORT" once the model is loaded and it listens
echo "serve: admin token in $WORLDCUP_ADMIN_TOKEN_FILE; loading the model, then listening on ${WORLDCUP_HOST:-127.0.0.1}:${WORLDCUP_PORT:-8000}" >&2
exec "$VENV"/bin/worldcup serve "$@"
