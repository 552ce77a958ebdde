#!/usr/bin/env bash
# Lint and type checks (configuration: pyproject.toml). Needs the venv of scripts/install.sh.
# Runs both checks and fails if either finds something; then reports the longest serving functions.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "lint: ruff check ."
.venv/bin/ruff check . || status=1
echo "lint: mypy audiosite inference registry ui gate bench"
.venv/bin/mypy audiosite inference registry ui gate bench || status=1
# A report, not a gate: the longest functions of the serving code (DESIGN.md: none over about 60 lines).
echo "lint: longest functions (report only)"
.venv/bin/python scripts/longest_functions.py 10 || true
exit $status
