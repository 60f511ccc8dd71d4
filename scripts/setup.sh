#!/usr/bin/env bash
# Creates .venv and installs torch (pinned, CPU build unless overridden) and then
# crossreplica with its example and development extras. Idempotent: a second run
# only re-installs the package.
#
#   CROSSREPLICA_TORCH      torch requirement to install (default: torch==2.13.0)
#   CROSSREPLICA_TORCH_INDEX  optional index URL for torch, e.g. the PyTorch CPU
#                           index on machines whose default index serves CUDA builds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_REQ=${CROSSREPLICA_TORCH:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first, on its own, so nothing later can pull a different (CUDA) build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${CROSSREPLICA_TORCH_INDEX:-}" ]; then
    "${PIP[@]}" "$TORCH_REQ" --index-url "$CROSSREPLICA_TORCH_INDEX"
  else
    "${PIP[@]}" "$TORCH_REQ"
  fi
fi
"${PIP[@]}" -e ".[examples,dev,benchmarks]"
