"""``python manage.py sync_config``: upsert the config file's models and publish the registry to Redis."""
import os

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from audiosite.serverconfig import ConfigError, get_config
from inference.runtime.context import KEYS, redis_url, sync_redis, sync_scheduler
from inference.scheduler import RuntimeMismatch
from registry.services import registry_start, start_summary


class Command(BaseCommand):
    help = "Upsert the models of server.json into the database and publish all registrations to Redis."

    def add_arguments(self, parser):
        parser.add_argument("--parallel-jobs", action="store_true", dest="parallel_jobs",
                            help="the deployment runs the parallel runtime (also AUDIOSITE_PARALLEL_JOBS=1)")

    def handle(self, *args, **options):
        if options["parallel_jobs"]:
            os.environ["AUDIOSITE_PARALLEL_JOBS"] = "1"  # read once, by get_config() below
        try:
            redis_url()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        try:
            config = get_config()
        except ConfigError as exc:
            raise CommandError("\n".join([f"{exc.source}:"] + [f"  - {p}" for p in exc.problems])) from None
        try:
            report, published = registry_start(config, sync_scheduler(), sync_redis(), KEYS)
        except RuntimeMismatch as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(start_summary(report, published))

