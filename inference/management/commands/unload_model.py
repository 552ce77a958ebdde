"""``python manage.py unload_model ID [--timeout-ms N]``: unload a model as a manager.

The same transition as ``POST /v1/models/unload`` (``registry.services.model_unload``):
the manager queues behind older requests, is a barrier for later ones
(R2.2), and destroys the pool through the one teardown path (R4.5).
"""
import asyncio

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from audiosite.errors import ApplicationError
from inference.runtime.context import async_context, redis_url
from registry.services import model_unload

OUTCOME_WORDS = {"destroyed": "pool destroyed", "not_loaded": "was not loaded",
                 "worker_lost": "its worker had stopped responding; its pool goes with it"}


class Command(BaseCommand):
    help = "Unload one model (waits for older requests; later requests reload it)."

    def add_arguments(self, parser):
        parser.add_argument("model_id")
        parser.add_argument("--timeout-ms", type=int, default=0, help="manager admission bound; 0 = unbounded")

    def handle(self, *args, **options):
        try:
            redis_url()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        if options["timeout_ms"] < 0:
            raise CommandError("--timeout-ms must be ≥ 0")
        try:
            outcome = asyncio.run(self._unload(options["model_id"], options["timeout_ms"]))
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"unloaded {options['model_id']} ({OUTCOME_WORDS[outcome]})")

    async def _unload(self, model_id: str, timeout_ms: int) -> str:
        ctx = await async_context()
        try:
            return (await model_unload(ctx, model_id, "cli", timeout_ms))["outcome"]
        finally:
            await ctx.listener.close()
