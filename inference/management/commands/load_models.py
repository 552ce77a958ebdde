"""``python manage.py load_models [ID …]``: load models now (default: every non-lazy one).

Each load goes through the same busy guard and single-flight load as a
request, so it queues behind running work and never loads a model twice.
"""
import asyncio

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from audiosite.errors import ApplicationError
from inference.runtime.context import async_context, redis_url
from inference.runtime import published
from inference.runtime.published import meta_all
from inference.services import ensure_loaded


class Command(BaseCommand):
    help = "Load registered models on a worker (default: all models that are not lazy)."

    def add_arguments(self, parser):
        parser.add_argument("model_ids", nargs="*")

    def handle(self, *args, **options):
        try:
            redis_url()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        failures = asyncio.run(self._load(options["model_ids"]))
        if failures:
            self.stderr.write(f"{failures} model(s) failed to load; they stay registered and load on first request")

    async def _load(self, wanted: list[str]) -> int:
        ctx = await async_context()
        metas = await meta_all(ctx)
        failures = 0
        for model_id in wanted or published.eager_ids(metas):
            if model_id not in metas:
                failures += 1
                self.stderr.write(f"loading {model_id} failed: not registered")
                continue
            lease = await ctx.scheduler.acquire(ctx.listener, model_id, 0)
            try:
                placement = await ensure_loaded(ctx, model_id, force=True)
                self.stdout.write(f"loaded {model_id} in {placement.load_ms:.0f} ms")
            except ApplicationError as exc:
                failures += 1
                self.stderr.write(f"loading {model_id} failed: {exc.message}")
            finally:
                await ctx.scheduler.release(model_id, lease.lease_id)
        await ctx.listener.close()
        return failures
