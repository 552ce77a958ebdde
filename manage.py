#!/usr/bin/env python
"""Django's command-line utility for audiosite (`python manage.py serve`, `migrate`, …)."""
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:  # a settings refusal (e.g. the secret key): one clear line, no traceback
        print(f"audiosite: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
