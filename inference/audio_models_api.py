"""``GET /v1/audio/models``: the speech synthesis models, as OpenAI-compatible speech servers list them for
Open WebUI (its ``get_available_models`` reads ``{"models": [{"id", ...}]}`` from ``<base>/audio/models``
when the base URL is not OpenAI's; without this route its TTS model box offers only ``tts-1``/``tts-1-hd``).
"""
from __future__ import annotations

from rest_framework.response import Response

from audiosite.http.apiview import APIView
from audiosite.serverconfig import get_config
from inference.runtime import published
from inference.runtime.context import async_context


class AudioModelsApi(APIView):
    """``GET /v1/audio/models`` (open, like ``/v1/audio/voices``) →
    ``{"models": [{"id", "name", "alias_of"?}]}``: every registered ``tts`` model (by id), then each alias
    (``ServerConfig.aliases``: ``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts`` and the configured ones) whose
    target is a registered ``tts`` model and whose name is no registered id, with ``alias_of``."""

    async def get(self, request):
        metas = await published.meta_all(await async_context())
        speech = [model_id for model_id, meta in metas.items() if meta.get("task") == "tts"]
        models: list[dict] = [{"id": model_id, "name": model_id} for model_id in speech]
        for alias, target in get_config().aliases().items():
            if alias not in metas and target in speech:
                models.append({"id": alias, "name": alias, "alias_of": target})
        return Response({"models": models})
