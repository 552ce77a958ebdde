"""Run daphne for audiosite: ``python -m audiosite.web -b HOST -p PORT audiosite.asgi:application``.

Same command line as ``daphne``, with audiosite's daphne classes installed first
(``audiosite.http.daphne_server``: bodies bounded as they arrive, request
deadlines, backpressure on streamed responses, WebSocket close codes, the drain
on SIGTERM/SIGINT) and daphne's WebSocket size limits set above
``live_ingest.max_chunk_bytes`` unless given. The process ends with
:func:`exit_now` once daphne has stopped.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from daphne.cli import CommandLineInterface

from audiosite.http.daphne_server import daphne_argv, install


def main() -> None:
    """Install audiosite's daphne classes, then run daphne's own command line on ``sys.argv[1:]``."""
    install()
    CommandLineInterface().run(daphne_argv(sys.argv[1:]))
    exit_now(0)


def exit_now(status: int) -> NoReturn:
    """End the web process without the interpreter's teardown, once daphne has stopped (drained).

    Everything of a request lives in Redis and the database; the process holds nothing worth a
    teardown, which only added noise: nanobind (soxr's binding) reports every native object still
    referenced then, ~17 ``nanobind: leaked ...`` lines for the resampler of each realtime session the
    drain cut. Logging is flushed first; no ``atexit`` work is needed by daphne, Django or Channels.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
