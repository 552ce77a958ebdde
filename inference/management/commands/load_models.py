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


def report_preload(result: PreloadResult, stdout, stderr) -> None:
    """Write the progress line of one preloaded model: ``loaded <id> in <ms> ms`` on ``stdout``, or
    ``loading <id> failed: …`` on ``stderr`` (a command's ``OutputWrapper``s; ``serve`` uses it too)."""
    if result.load_ms is None:
        stderr.write(f"loading {result.model_id} failed: {result.error}")
    else:
        stdout.write(f"loaded {result.model_id} in {result.load_ms:.0f} ms")
        stdout.flush()


def report_failures(results: list[PreloadResult], stderr) -> None:
    """Write how many of ``results`` failed, when any did."""
    failures = sum(result.load_ms is None for result in results)
    if failures:
        stderr.write(f"{failures} model(s) failed to load; they stay registered and load on first request")


class Command(BaseCommand):
    help = "Load registered models on a worker (default: all models that are not lazy)."

    def add_arguments(self, parser):
        parser.add_argument("model_ids", nargs="*")

    def handle(self, *args, **options):
        try:
            redis_url()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        report_failures(asyncio.run(self._load(options["model_ids"] or None)), self.stderr)

    async def _load(self, wanted: list[str] | None) -> list[PreloadResult]:
        ctx = await async_context()
        try:
            return await models_preload(ctx, wanted, lambda result: report_preload(result, self.stdout, self.stderr))
        finally:
            await ctx.listener.close()
