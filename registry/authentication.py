"""Async authentication of the management routes (``Authorization: Token`` and the admin session).

DRF's ``TokenAuthentication`` and ``SessionAuthentication`` are synchronous
(a database read in the view), so ``adrf`` runs them in a thread. These
subclasses add ``aauthenticate`` coroutines, which ``audiosite.http.apiview``
awaits on the event loop: the database reads go through Django's async ORM,
and only a request that carries credentials reads anything. The sync
``authenticate`` methods stay as DRF wrote them (other callers, tests).

The session is read from its cookie here (the API has no session middleware,
see ``audiosite.http.handler``); a session-authenticated request must pass DRF's
CSRF check exactly as with ``SessionAuthentication``.

Tokens are ``registry.models.ApiToken`` rows, which hold only the SHA-256 of
each token: a presented token is hashed and looked up by that digest, both in
``aauthenticate`` and in the sync ``authenticate_credentials``.
"""
from __future__ import annotations

from importlib import import_module

from django.conf import settings
from django.contrib.auth import aget_user
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication, TokenAuthentication, get_authorization_header

from .models import ApiToken


class AsyncTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>`` or ``Authorization: Bearer <key>`` (the scheme OpenAI's clients
    send; ``manage.py issue_token``), looked up by digest, asynchronously.

    Returns ``(user, ApiToken)``; raises ``AuthenticationFailed`` (401) for an unknown token or an
    inactive user, except that with ``unknown_bearer_is_anonymous`` an unknown or malformed (empty, with
    spaces) ``Bearer`` key counts as no credentials: an OpenAI client always sends its API key, which a
    status read must not refuse.
    """

    model = ApiToken
    keywords = ("Token", "Bearer")
    unknown_bearer_is_anonymous = False

    def __init__(self, unknown_bearer_is_anonymous: bool = False):
        self.unknown_bearer_is_anonymous = unknown_bearer_is_anonymous

    def authenticate(self, request):
        """DRF's sync entry point, with both schemes (:meth:`token_key`)."""
        try:
            key = self.token_key(request)
            return None if key is None else self.authenticate_credentials(key)
        except exceptions.AuthenticationFailed:
            if self._bearer_ignored(request):
                return None
            raise

    def _bearer_ignored(self, request) -> bool:
        """True when an unknown key counts as none: ``unknown_bearer_is_anonymous`` and a ``Bearer`` header."""
        scheme = get_authorization_header(request).split()[:1]
        return self.unknown_bearer_is_anonymous and bool(scheme) and scheme[0].lower() == b"bearer"

    def authenticate_credentials(self, key: str):
        """DRF's sync lookup, by the token's digest (``ApiToken.digest_of``)."""
        try:
            token = ApiToken.objects.select_related("user").get(digest=ApiToken.digest_of(key))
        except ApiToken.DoesNotExist:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        return token.user, token

    def token_key(self, request) -> str | None:
        """The key of an ``Authorization: Token <key>`` or ``Bearer <key>`` header (scheme case-insensitive),
        None without one (DRF's parsing).

        Raises:
            AuthenticationFailed: a ``Token`` header without a key, with spaces, or not text.
        """
        auth = get_authorization_header(request).split()
        if not auth or auth[0].lower() not in {keyword.lower().encode() for keyword in self.keywords}:
            return None
        if len(auth) == 1:
            raise exceptions.AuthenticationFailed("Invalid token header. No credentials provided.")
        if len(auth) > 2:
            raise exceptions.AuthenticationFailed("Invalid token header. Token string should not contain spaces.")
        try:
            return auth[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed(
                "Invalid token header. Token string should not contain invalid characters.") from None

    async def aauthenticate(self, request):
        try:
            key = self.token_key(request)
        except exceptions.AuthenticationFailed:  # a malformed header: on a read, an OpenAI key counts as none
            if self._bearer_ignored(request):
                return None
            raise
        if key is None:
            return None
        try:
            token = await ApiToken.objects.select_related("user").aget(digest=ApiToken.digest_of(key))
        except ApiToken.DoesNotExist:
            if self._bearer_ignored(request):
                return None
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        return token.user, token


class AsyncSessionAuthentication(SessionAuthentication):
    """The Django admin's session cookie (CSRF enforced), read asynchronously."""

    async def aauthenticate(self, request):
        django_request = request._request
        session_key = django_request.COOKIES.get(settings.SESSION_COOKIE_NAME)
        if not session_key:
            return None
        if not hasattr(django_request, "session"):
            django_request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = await aget_user(django_request)
        if not user or not user.is_active:
            return None
        self.enforce_csrf(request)
        return user, None
