"""Durable truth about models: registrations and the audit log of their lifecycle; and the API tokens.

Live coordination (queues, leases, who holds the loaded pool) is in Redis;
these rows record what is registered, its last known lifecycle state and
error, and every lifecycle event. Only ``registry.records`` writes them.
"""
import hashlib

from django.conf import settings
from django.db import models


class LifecycleState(models.TextChoices):
    """Conceptual per-model states of CONTRACT R4."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    RECONFIGURING = "reconfiguring"
    UNLOADING = "unloading"


class ModelRegistration(models.Model):
    """One registered model id and how to load it.

    ``busy_timeout_ms`` is the model's admission ceiling in ms (null = the
    server's); ``lazy`` null = the server's ``lazy_load``. ``options`` holds
    ``load_options``, ``session_options`` and ``default_request_options``, the voice presets,
    ``modes`` when the registration states the modes it serves (absent: its family's), and
    ``max_run_ms`` (a run's deadline, null = the default), ``max_batch`` and ``batch_window_ms`` (native
    batching, null = 1 and 0); none has a column of its own.
    """

    class Source(models.TextChoices):
        CONFIG = "config", "config file"
        API = "api", "management API"

    model_id = models.CharField("id", max_length=128, unique=True)
    family = models.CharField(max_length=64)
    task = models.CharField(max_length=64)
    mode = models.CharField(max_length=16, default="offline")
    path = models.CharField(max_length=1024, blank=True, default="")
    options = models.JSONField(default=dict, blank=True)
    busy_timeout_ms = models.PositiveBigIntegerField(null=True, blank=True)
    slots = models.PositiveSmallIntegerField(null=True, blank=True, help_text="parallel runtime only; null = 1")
    lazy = models.BooleanField(null=True, blank=True)
    source = models.CharField(max_length=8, choices=Source.choices)
    state = models.CharField(max_length=16, choices=LifecycleState.choices, default=LifecycleState.UNLOADED)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    loaded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["model_id"]
        permissions = [("manage_models", "Can load, reconfigure and unload models")]

    def __str__(self) -> str:
        return self.model_id

    def as_meta(self) -> dict:
        """The JSON published to Redis for every process (see ``services.registry_publish``)."""
        return {
            "id": self.model_id,
            "family": self.family,
            "task": self.task,
            "mode": self.mode,
            "path": self.path or None,
            "load_options": self.options.get("load_options", {}),
            "session_options": self.options.get("session_options", {}),
            "default_request_options": self.options.get("default_request_options", {}),
            "voice_presets": self.options.get("voice_presets", {}),
            "default_voice_preset": self.options.get("default_voice_preset"),
            "modes": self.options.get("modes"),
            "busy_timeout_ms": self.busy_timeout_ms,
            "max_run_ms": self.options.get("max_run_ms"),
            "max_batch": self.options.get("max_batch"),
            "batch_window_ms": self.options.get("batch_window_ms"),
            "slots": self.slots,
            "lazy": self.lazy,
            "source": self.source,
            "created": int(self.created_at.timestamp()) if self.created_at else None,
        }


class LifecycleEvent(models.Model):
    """Audit log: who did what to which model, when, and how it ended."""

    class Outcome(models.TextChoices):
        OK = "ok"
        FAILED = "failed"

    model_id = models.CharField(max_length=128, db_index=True)
    event = models.CharField(max_length=32)
    outcome = models.CharField(max_length=8, choices=Outcome.choices)
    actor = models.CharField(max_length=128, blank=True, default="")
    detail = models.TextField(blank=True, default="")
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.model_id} {self.event} {self.outcome}"


class ApiToken(models.Model):
    """A token for the management routes (``Authorization: Token <token>``), stored only as a digest.

    ``digest`` is the SHA-256 (hex) of the token's text; the text itself is
    printed once by ``manage.py issue_token`` and kept nowhere. A token is 256
    random bits (``secrets.token_urlsafe(32)``), so a fast hash is enough: a
    slow password hash only protects guessable secrets. Authentication looks the
    presented token up by its digest (``registry.authentication``), so no
    comparison ever runs on the secret itself.
    """

    digest = models.CharField(max_length=64, unique=True, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"token of {self.user} created {self.created_at:%Y-%m-%d %H:%M:%S}"

    @staticmethod
    def digest_of(token: str) -> str:
        """The stored form of ``token``: its SHA-256 as 64 lowercase hex characters."""
        return hashlib.sha256(token.encode("utf-8")).hexdigest()
