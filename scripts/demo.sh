#!/usr/bin/env bash
# The main job on the embedded defaults: make a key, embed a 16-bit payload in
# a generation, then decode and detect it from the text alone.
set -euo pipefail
cd "$(dirname "$0")/.."
WC=.venv/bin/worldcup
key=${WORLDCUP_KEY_FILE:-.cache/demo.key}
mkdir -p "$(dirname "$key")"
[ -f "$key" ] || "$WC" keygen --out "$key"
bits=${BITS:-1011001110001111}
prompt=${PROMPT:-"Explain why the sky is blue in a few paragraphs."}
echo "== generate (payload $bits)" >&2
text=$("$WC" generate --key-file "$key" --bits "$bits" --prompt "$prompt" --chat \
  --max-new-tokens 128 --min-new-tokens 64 --no-repeat-ngram-size 4)
printf '%s\n\n' "$text"
echo "== decode" >&2
printf '%s' "$text" | "$WC" decode --key-file "$key" --num-bits 16
echo "== detect" >&2
printf '%s' "$text" | "$WC" detect --key-file "$key"
