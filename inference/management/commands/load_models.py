"""``python manage.py load_models [ID …]``: load models now (default: every non-lazy one).

Each load goes through the same busy guard and single-flight load as a
request, so it queues behind running work and never loads a model twice
(``inference.services.models_preload``, which ``serve`` also runs at start-up).
"""
import asyncio

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from inference.runtime.context import async_context, redis_url
from inference.services import PreloadResult, models_preload


def preload_line(result: PreloadResult) -> str:
    """The progress line of one preloaded model (``loaded <id> in <ms> ms`` or ``loading <id> failed: …``)."""
    if result.load_ms is None:
        return f"loading {result.model_id} failed: {result.error}"
    return f"loaded {result.model_id} in {result.load_ms:.0f} ms"


FAILURES_LINE = "{} model(s) failed to load; they stay registered and load on first request"


class Command(BaseCommand):
    help = "Load registered models on a worker (default: all models that are not lazy)."

    def add_arguments(self, parser):
        parser.add_argument("model_ids", nargs="*")

    def handle(self, *args, **options):
        try:
            redis_url()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        results = asyncio.run(self._load(options["model_ids"] or None))
        failures = sum(result.load_ms is None for result in results)
        if failures:
            self.stderr.write(FAILURES_LINE.format(failures))

    async def _load(self, wanted: list[str] | None) -> list[PreloadResult]:
        ctx = await async_context()
        try:
            return await models_preload(ctx, wanted, self._report)
        finally:
            await ctx.listener.close()

    def _report(self, result: PreloadResult) -> None:
        (self.stderr if result.load_ms is None else self.stdout).write(preload_line(result))
