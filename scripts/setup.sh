#!/usr/bin/env bash
# Creates .venv and installs torch (pinned, CPU build unless overridden) and then
# crossreplica with its example and development extras.
#
# Idempotent and quick when nothing changed: crossreplica is installed in editable
# mode, so changes to its code take effect without reinstalling. It is installed
# again only when what the install depends on changed: pyproject.toml, the version
# (crossreplica/version.py), this checkout's path, or the torch requirement.
# .venv/.crossreplica-installed records those after each install.
#
#   CROSSREPLICA_TORCH      torch requirement to install (default: torch==2.13.0)
#   CROSSREPLICA_TORCH_INDEX  optional index URL for torch, e.g. the PyTorch CPU
#                           index on machines whose default index serves CUDA builds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_REQ=${CROSSREPLICA_TORCH:-torch==2.13.0}
STAMP=.venv/.crossreplica-installed

# What an install depends on, one line each (cksum: POSIX, no Python needed).
wanted="checkout $PWD
torch $TORCH_REQ
pyproject.toml $(cksum <pyproject.toml)
version.py $(cksum <crossreplica/version.py)"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ]; then
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first, on its own, so nothing later can pull a different (CUDA) build; again
# when the requirement differs from the one the last install recorded.
if ! .venv/bin/python -c "import torch" 2>/dev/null ||
   { [ -f "$STAMP" ] && ! grep -qxF "torch $TORCH_REQ" "$STAMP"; }; then
  echo "setup.sh: installing $TORCH_REQ into .venv" >&2
  if [ -n "${CROSSREPLICA_TORCH_INDEX:-}" ]; then
    "${PIP[@]}" "$TORCH_REQ" --index-url "$CROSSREPLICA_TORCH_INDEX"
  else
    "${PIP[@]}" "$TORCH_REQ"
  fi
fi
echo "setup.sh: installing crossreplica (editable) and its extras into .venv" >&2
rm -f "$STAMP"
"${PIP[@]}" -e ".[examples,dev,benchmarks]"
printf '%s\n' "$wanted" >"$STAMP"
