#!/usr/bin/env bash
# Install (scripts/install.sh) and run the whole test suite against real
# PostgreSQL and Redis. Defaults match a machine running both locally:
#   DATABASE_URL  postgres://postgres@127.0.0.1:5432/audiosite  (tests create test_* databases)
#   REDIS_URL     redis://127.0.0.1:6379/15   (used only with AUDIOSITE_TEST_WORKERS=0: the tests FLUSH
#                 databases 3 and 8 to 15 of that server; each xdist worker starts a Redis of its own,
#                 see tests/redis_per_worker.py)
#   AUDIOSITE_TEST_WORKERS  3: pytest-xdist processes (--dist loadfile); 0 = one process. On 2 cores
#                 3 took 428-432 s against 488-528 s with 2 (4: 436 s, the cores are then saturated)
# Extra arguments go to pytest (e.g. scripts/test.sh -k scheduler). Lint: scripts/lint.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/audiosite}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/15}
export AUDIOSITE_REQUIRE_SERVICES=1
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -n "${AUDIOSITE_TEST_WORKERS:-3}" --dist loadfile "$@"
