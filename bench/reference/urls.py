"""One route: ``GET /health`` → :class:`MinimalApi`."""
from adrf.views import APIView
from django.urls import path
from rest_framework.response import Response


class MinimalApi(APIView):
    """A minimal adrf APIView: no authentication, no permissions, a constant body."""

    async def get(self, request):
        return Response({"status": "ok"})


urlpatterns = [path("health", MinimalApi.as_view())]
