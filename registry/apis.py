"""Service, status and management routes (API.md): ``/health``, ``/v1/models[/{id}]``, ``/v1/models/load``,
``/v1/models/unload``, ``/v1/tasks/unload_models``, ``/v1/tasks/unload_all_models``. Views only translate
HTTP ↔ ``registry.services``."""
from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.http import HttpResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from rest_framework.exceptions import NotAuthenticated
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.response import Response

from audiosite.http.apiview import APIView, authenticate
from audiosite.drain import DRAIN
from audiosite.errors import InvalidRequest, ManagementDisabled, ManagePermissionDenied, NotFound
from audiosite.serverconfig import get_config
from audiosite.input_checks import JSONParser, check_length, validated
from inference.backend import resolve_backend
from inference.runtime import metrics
from inference.runtime.context import async_context

from . import services
from .authentication import AsyncSessionAuthentication, AsyncTokenAuthentication
from .permissions import MANAGEMENT_DISABLED, management_enabled, may_manage
from .selectors import deployment_backend, deployment_census, model_gauges, model_status_list

from .serializers import (ManagementBodySerializer, ModelLoadInputSerializer, ModelUnloadInputSerializer,
                          UnloadAllInputSerializer, UnloadModelsInputSerializer)

_backend: str | None = None


async def _backend_name() -> str:
    """The inference backend this process resolved (``inference.backend.resolve_backend``), probed once."""
    global _backend
    if _backend is None:  # probing may load onnxruntime: once, off the event loop
        _backend = await asyncio.to_thread(resolve_backend, get_config().backend)
    return _backend


class HealthApi(APIView):
    """``GET /health``: ``{"status", "runtime", "backend", "models", "workers", "ui", "ui_management"}``.

    ``status`` is ``"ok"`` (200) while at least one GPU worker is alive,
    ``"degraded"`` (503) while none is (a model request would then get 503
    ``no_worker`` or wait for a worker being started), and ``"draining"``
    (503) once this web process drains (``audiosite.drain``, R8.4: readiness
    goes first, so a load balancer stops sending); ``workers`` is the
    number of live workers and ``models`` of registrations; ``backend`` is
    ``"cuda"`` only when every live worker's sessions get the CUDA provider
    (``selectors.deployment_backend``). One Redis round trip (``census.lua``):
    the route is benchmarked by ``bench_latency``.
    """

    async def get(self, request):
        ctx = await async_context()
        census = await deployment_census(ctx)
        backend = deployment_backend(census, await _backend_name())
        status = "draining" if DRAIN.draining else "degraded" if census.live_workers == 0 else "ok"
        return Response({"status": status, "runtime": get_config().runtime,
                         "backend": backend, "models": census.models, "workers": census.live_workers,
                         "ui": get_config().ui, "ui_management": management_enabled()},
                        status=200 if status == "ok" else 503)


class AnyAccept(BaseContentNegotiation):
    """Never refuse for ``Accept`` (the body is always the Prometheus text; errors stay JSON)."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class MetricsApi(APIView):
    """``GET /metrics``: Prometheus text (``inference.runtime.metrics``; names in docs/operations.md "Metrics").

    Per-model gauges from one atomic scheduler snapshot, the deployment's
    counters and histograms (kept in Redis by every web and worker process;
    every registered model's series from the first scrape, at 0), the CPU and
    memory each live web process and worker published, ``audiosite_build_info``
    and ``audiosite_draining`` of this process. Open like ``/health``; read
    also while draining. Four Redis round trips plus the registry read.
    """

    content_negotiation_class = AnyAccept

    async def get(self, request):
        ctx = await async_context()
        gauges = await model_gauges(ctx)
        stored = await metrics.read_stored(ctx.redis)
        processes = await metrics.read_processes(ctx.redis)
        build = metrics.BuildInfo(await asyncio.to_thread(metrics.version), get_config().runtime,
                                  await _backend_name())
        return HttpResponse(metrics.exposition(gauges, stored, DRAIN.draining, processes, build),
                            content_type=CONTENT_TYPE_PLAIN_0_0_4)


# -- management routes (gated: ui_management on AND registry.manage_models) ---------------------------

class ManagementGate(BasePermission):
    """Gate of every management route (API.md), checked in this order.

    ``ui_management`` off → 403 ``forbidden`` (for everyone, before any
    credential check); no or invalid credentials → 401
    ``authentication_error``; an authenticated caller without
    ``registry.manage_models`` → 403 ``forbidden``. Async: the credentials are
    looked up only after the first check (``audiosite.http.apiview``).
    """

    async def has_permission(self, request, view) -> bool:
        if not management_enabled():
            raise ManagementDisabled(MANAGEMENT_DISABLED)
        user = await authenticate(request)
        if user is None or not user.is_authenticated:
            raise NotAuthenticated("management routes need credentials: 'Authorization: Token <key>' "
                                   "(python manage.py issue_token USER) or a Django admin session")
        if not await sync_to_async(may_manage)(user):
            raise ManagePermissionDenied(f"user {user.get_username()!r} lacks the registry.manage_models "
                                         "permission")
        return True


class ManagementApi(APIView):
    """Base of the management views: token or session auth, then :class:`ManagementGate`."""

    authentication_classes = [AsyncTokenAuthentication, AsyncSessionAuthentication]
    permission_classes = [ManagementGate]
    parser_classes = [JSONParser]

    def get_authenticate_header(self, request):
        return "Token"

    def get_authenticators(self):
        """Token (``Token`` or ``Bearer``) and session. On a read (GET, HEAD), an unknown ``Bearer`` key
        counts as no credentials: OpenAI's clients send their API key with every call, and a status
        read is open; a management call with it gets 401 as with any unknown token."""
        read = getattr(self, "request", None) is not None and self.request.method in ("GET", "HEAD")
        return [AsyncTokenAuthentication(unknown_bearer_is_anonymous=read), AsyncSessionAuthentication()]

    @staticmethod
    def actor(request) -> str:
        return request.user.get_username()


async def shows_private_fields(request) -> bool:
    """True when the caller of a status read passes the management gate (sees ``path``, see
    ``registry.selectors.PRIVATE_FIELDS``).

    With management off nobody does, and no credential is looked up. Otherwise
    credentials are optional: none → False; invalid → 401 (DRF's rule for any
    route that authenticates).
    """
    if not management_enabled():
        return False
    user = await authenticate(request)
    return user is not None and user.is_authenticated and await sync_to_async(may_manage)(user)


def include_params(request) -> bool:
    """The status routes' ``include_params`` query flag (API.md): ``1``/``true`` adds each entry's
    request options, ``0``/``false`` or absent does not.

    Raises:
        InvalidRequest: any other value.
    """
    value = request.query_params.get("include_params", "0").strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise InvalidRequest("include_params must be 1 or 0 (true or false)", param="include_params")
    return value in ("1", "true")


class ModelListApi(ManagementApi):
    """``GET /v1/models`` (open; legacy: no slot fields, R1.2; parallel: slot counters; ``path`` only
    for callers passing the management gate; ``?include_params=1``: each entry's ``request_options``)."""

    permission_classes = []

    def get_authenticators(self):  # credentials matter only for the private fields, only when management is on
        return super().get_authenticators() if management_enabled() else []

    async def get(self, request):
        ctx = await async_context()
        private = await shows_private_fields(request)
        params = include_params(request)
        return Response({"object": "list",
                         "data": await model_status_list(ctx, private=private, include_params=params)})


class ModelDetailApi(ManagementApi):
    """``GET /v1/models/{id}`` (open, as one entry of :class:`ModelListApi`) and ``DELETE /v1/models/{id}``
    (management: unregister)."""

    async def get(self, request, model_id: str):
        ctx = await async_context()
        entries = await model_status_list(ctx, model_id, private=await shows_private_fields(request),
                                          include_params=include_params(request))
        if not entries:
            raise NotFound(f"model {model_id!r} is not registered", param="model")
        return Response(entries[0])

    async def delete(self, request, model_id: str):
        ctx = await async_context()
        return Response(await services.model_unregister(ctx, model_id, self.actor(request)))

    def get_authenticators(self):  # credentials matter for DELETE, and for GET's private fields
        return super().get_authenticators() if self.request.method == "DELETE" or management_enabled() else []

    def get_permissions(self):  # status reads stay open; only DELETE is gated
        return super().get_permissions() if self.request.method == "DELETE" else []


def _json_body(request, serializer_class: type[ManagementBodySerializer] | None) -> dict:
    """The validated JSON object of a management request (an absent or empty body reads as ``{}``).

    Args:
        serializer_class: the route's input serializer (``registry.serializers``); None for a
            model entry (:class:`ModelLoadInputSerializer`: the outer shape; the service checks the values).

    Raises:
        PayloadTooLarge, LengthRequired: over ``max_request_body_bytes`` (413); chunked (411).
        InvalidRequest: not a JSON object, nested too deeply, text that is not plain, an unknown key,
            a bad field (400, ``param`` = the key).
        UnsupportedMediaType: not ``application/json`` (415, from the parser).
    """
    data = {}
    if check_length(request, body_optional=True) > 0:
        try:
            data = request.data
        except RecursionError:
            raise InvalidRequest("the JSON body is nested too deeply") from None
    return validated((serializer_class or ModelLoadInputSerializer)(data=data))


class ModelLoadApi(ManagementApi):
    """``POST /v1/models/load``: register a new id or reconfigure an existing one (R4.4, R4.6)."""

    async def post(self, request):
        ctx = await async_context()
        return Response(await services.model_register_or_reconfigure(ctx, _json_body(request, None),
                                                                      self.actor(request)))


class ModelUnloadApi(ManagementApi):
    """``POST /v1/models/unload`` ``{"id"}`` → ``{"id", "loaded": false}`` (idempotent, R4.5)."""

    async def post(self, request):
        model_id = _json_body(request, ModelUnloadInputSerializer)["id"]
        ctx = await async_context()
        outcome = await services.model_unload(ctx, model_id, self.actor(request))
        return Response({"id": outcome["id"], "loaded": outcome["loaded"]})


class UnloadModelsApi(ManagementApi):
    """``POST /v1/tasks/unload_models`` ``{"model_ids": [...]}`` (R5)."""

    async def post(self, request):
        ids = _json_body(request, UnloadModelsInputSerializer)["model_ids"]
        ctx = await async_context()
        return Response(await services.models_bulk_unload(ctx, ids, self.actor(request)))


class UnloadAllModelsApi(ManagementApi):
    """``POST /v1/tasks/unload_all_models`` (R5)."""

    async def post(self, request):
        _json_body(request, UnloadAllInputSerializer)  # no keys: an empty body or {}
        ctx = await async_context()
        return Response(await services.models_bulk_unload(ctx, None, self.actor(request)))
