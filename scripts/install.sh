#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned dependencies into it.
# Idempotent: a second run only checks. Ends with exactly one onnxruntime
# distribution installed: onnxruntime-gpu (tests/test_install.py checks it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --no-deps -r requirements.txt
# If anything ever pulled the CPU wheel in, it shadows the GPU one: remove it
# and restore the GPU wheel's files.
if .venv/bin/python -m pip show onnxruntime >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall --quiet -y onnxruntime
  .venv/bin/python -m pip install --quiet --no-deps --force-reinstall "$(grep '^onnxruntime-gpu==' requirements.txt)"
fi
echo "audiosite: dependencies installed in .venv"
