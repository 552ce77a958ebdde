"""Service and status routes: ``/health``, ``/v1/models``, ``/v1/models/{id}``."""
from __future__ import annotations

import asyncio

from adrf.views import APIView
from rest_framework.response import Response

from audiosite.errors import NotFound
from audiosite.serverconfig import get_config
from inference.backend import resolve_backend
from inference.runtime import runtime_name
from inference.runtime.context import async_context

from .selectors import model_meta_all, model_status_list


_backend: str | None = None


class HealthApi(APIView):
    """``GET /health``."""

    async def get(self, request):
        ctx = await async_context()
        models = await model_meta_all(ctx)
        global _backend
        if _backend is None:  # probing may load onnxruntime: once, off the event loop
            _backend = await asyncio.to_thread(resolve_backend, get_config().backend)
        backend = _backend
        return Response({"status": "ok", "runtime": runtime_name(), "backend": backend, "models": len(models),
                         "ui": False, "ui_management": False})


class ModelListApi(APIView):
    """``GET /v1/models`` (legacy: no slot fields, R1.2; parallel: slot counters)."""

    async def get(self, request):
        ctx = await async_context()
        return Response({"object": "list", "data": await model_status_list(ctx)})


class ModelDetailApi(APIView):
    """``GET /v1/models/{id}``."""

    async def get(self, request, model_id: str):
        ctx = await async_context()
        entries = await model_status_list(ctx, model_id)
        if not entries:
            raise NotFound(f"model {model_id!r} is not registered", param="model")
        return Response(entries[0])
