"""Run daphne for audiosite: ``python -m audiosite.web -b HOST -p PORT audiosite.asgi:application``.

Same command line as ``daphne``, with one difference: Twisted's own parsing of
POST bodies into ``request.args`` (``parsePOSTFormSubmission``, on by default)
is switched off. Daphne never uses those args (the body goes to Django
as-is), but Twisted parses a whole multipart upload in its reactor thread
before the view can refuse it: measured, a 300 MB upload held about 4 GB and
stalled every other request for about 30 s. With it off the body is only
spooled (to a temporary file past 100 KB) and the view's
``max_request_body_bytes`` check answers 413 without parsing it; a malformed
multipart body gets the JSON 400 of the API instead of Twisted's empty one.
"""
from __future__ import annotations

import daphne.http_protocol
from daphne.cli import CommandLineInterface

_original_init = daphne.http_protocol.WebRequest.__init__


def _init_without_form_parsing(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    self._parsePOSTFormSubmission = False  # twisted.web.http.Request's documented switch


def main() -> None:
    """Patch the request class, then hand over to daphne's own command line."""
    daphne.http_protocol.WebRequest.__init__ = _init_without_form_parsing
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
