"""``python manage.py wyoming [--uri tcp://0.0.0.0:10300] [--config FILE]``: the Wyoming protocol server
(Home Assistant) beside a running ``serve`` (or a distributed deployment), on the same Redis, models
and scheduler as HTTP (``inference.wyoming_server``; docs/integrations/home-assistant.md).

It starts no worker: its requests are served by the workers of the deployment it joins. Prints
``wyoming listening on tcp://HOST:PORT`` once it accepts connections; stops on SIGINT/SIGTERM.
"""
import asyncio
import logging

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from audiosite.env import env_str
from audiosite.serverconfig import ConfigError, install_config, load_config
from inference import wyoming_server
from inference.runtime.context import redis_url


class Command(BaseCommand):
    help = "Serve ASR and TTS over the Wyoming protocol (Home Assistant) on the running deployment's models."

    def add_arguments(self, parser):
        parser.add_argument("--uri", default="tcp://0.0.0.0:10300", help="tcp://HOST:PORT (default tcp://0.0.0.0:10300)")
        parser.add_argument("--config", help="server.json (default: AUDIOSITE_CONFIG or config/server.json)")

    def handle(self, *args, **options):
        try:
            redis_url()
            install_config(load_config(options.get("config") or env_str("AUDIOSITE_CONFIG")))
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        except ConfigError as exc:
            raise CommandError("\n".join([f"invalid configuration ({exc.source}):", *exc.problems])) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

        def ready(host: str, port: int) -> None:
            self.stdout.write(f"wyoming listening on tcp://{host}:{port}")
            self.stdout.flush()

        try:
            asyncio.run(wyoming_server.serve_forever(options["uri"], ready))
        except (ValueError, OSError) as exc:
            raise CommandError(str(exc)) from None
