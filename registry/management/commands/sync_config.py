"""``python manage.py sync_config``: upsert the config file's models and publish the registry to Redis.

Meant for a deployment whose processes are stopped (the start order of docs/operations.md, "Scale-out"):
it writes registrations and marks changed models unloaded without tearing anything down. Run against a
live deployment, it refuses when a model it would change or remove is in use (a pool loaded or loading,
a teardown, requests or managers holding or waiting for it): changing it under its pool would leave the
pool running the old configuration. Such a model is changed through the management API (which waits for
older requests and tears the pool down, R4.4), or unloaded first (``manage.py unload_model``).
Tolerated race: a request may load such a model between the check and the write.
"""
import asyncio
import os

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from audiosite.serverconfig import ConfigError, get_config
from inference.runtime.context import redis_url, sync_scheduler
from inference.scheduler import RuntimeMismatch
from registry.selectors import models_in_use
from registry.records import registration_sync_plan, registry_start, registry_start_summary


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
        scheduler = sync_scheduler()
        try:
            scheduler.claim_runtime(config.runtime)  # a process of the other runtime hears that first (R1.4)
        except RuntimeMismatch as exc:
            raise CommandError(str(exc)) from None
        plan = registration_sync_plan(config)
        touched = plan["updated"] + plan["removed"]
        in_use = models_in_use(asyncio.run(scheduler.snapshot(touched)))
        if in_use:
            raise CommandError(
                f"this file changes or removes model(s) {in_use}, which are in use on this deployment: changing a "
                "registration under its pool leaves the pool running the old configuration. Unload each first "
                "(python manage.py unload_model ID), or apply the change through the management API "
                "(POST /v1/models/load reconfigures, DELETE /v1/models/<id> unregisters), then run sync_config "
                "again. Nothing was written.")
        try:
            report, published = registry_start(config, scheduler)
        except RuntimeMismatch as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(registry_start_summary(report, published))

