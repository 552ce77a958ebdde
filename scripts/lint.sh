#!/usr/bin/env bash
# Lint and type checks (configuration: pyproject.toml). Needs the venv of scripts/install.sh.
# Runs both checks and fails if either finds something.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "lint: ruff check ."
.venv/bin/ruff check . || status=1
echo "lint: mypy audiosite inference registry ui"
.venv/bin/mypy audiosite inference registry ui || status=1
exit $status
