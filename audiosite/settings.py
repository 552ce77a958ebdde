"""Django settings for audiosite: one file, infrastructure from the environment.

Only infrastructure lives here (database, Redis, secret key, paths). What the
server serves lives in ``server.json`` (see ``audiosite.serverconfig``).

Environment variables (all optional):

``DATABASE_URL``
    Any URL ``dj-database-url`` understands. Default: an SQLite file at
    ``var/audiosite.sqlite3`` inside the checkout.
``REDIS_URL``
    ``redis://host:port/db``. Default: unset; ``manage.py serve`` then starts a
    private Redis server and sets it for its children. Any other process that
    needs Redis without it fails with ``ImproperlyConfigured``.
``AUDIOSITE_SECRET_KEY``
    Django secret key. Default: a random key kept in ``var/secret_key``.
``AUDIOSITE_DEBUG``
    ``1``/``0``. Default ``0``.

Every helper below fails loudly (``ImproperlyConfigured``) on a malformed value
instead of falling back silently.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str | None = None) -> str | None:
    """Return the environment variable ``name`` stripped, or ``default`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value if value else default


def env_bool(name: str, default: bool) -> bool:
    """Parse ``name`` as a boolean (1/0, true/false, yes/no, on/off).

    Raises:
        ImproperlyConfigured: the value is set but is none of those words.
    """
    raw = env_str(name)
    if raw is None:
        return default
    lowered = raw.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_url(name: str, default: str | None, schemes: tuple[str, ...]) -> str | None:
    """Return ``name`` as a URL whose scheme is one of ``schemes``.

    Raises:
        ImproperlyConfigured: the value is set but has another scheme.
    """
    raw = env_str(name, default)
    if raw is None:
        return None
    scheme = raw.split("://", 1)[0] if "://" in raw else ""
    if scheme not in schemes:
        raise ImproperlyConfigured(f"{name}={raw!r}: scheme must be one of {', '.join(schemes)}")
    return raw


def env_json(name: str, default):
    """Parse ``name`` as JSON, or return ``default`` when unset or empty.

    Raises:
        ImproperlyConfigured: the value is set but is not valid JSON.
    """
    raw = env_str(name)
    if raw is None:
        return default
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ImproperlyConfigured(f"{name} is not valid JSON: {exc.msg}") from None
    except ValueError as exc:  # an integer literal over Python's 4300-digit conversion limit
        raise ImproperlyConfigured(f"{name} is not valid JSON: {exc}") from None


def env_path(name: str, default: Path) -> Path:
    """Return ``name`` as a filesystem path, or ``default`` when unset or empty."""
    raw = env_str(name)
    return Path(raw) if raw else default


def _secret_key() -> str:
    explicit = env_str("AUDIOSITE_SECRET_KEY")
    if explicit:
        return explicit
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    key_file = VAR_DIR / "secret_key"
    try:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return key_file.read_text().strip()
    key = secrets.token_urlsafe(50)
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


VAR_DIR = env_path("AUDIOSITE_VAR_DIR", BASE_DIR / "var")
SECRET_KEY = _secret_key()
DEBUG = env_bool("AUDIOSITE_DEBUG", False)
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "registry",
    "inference",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
# MIDDLEWARE serves the paths below (the admin, the future /ui/, static files) through Django's own
# ASGIHandler. Every other path (the API) goes through audiosite.handlers.ApiHandler with
# API_MIDDLEWARE: async-only middleware, so a status or inference request makes no thread hop. The
# API authenticates sessions and tokens itself (registry.authentication), asynchronously.
FULL_STACK_PATH_PREFIXES = ("/admin/", "/ui/")
API_MIDDLEWARE = [
    "audiosite.middleware.SecurityOnLoop",
    "audiosite.middleware.CommonOnLoop",
]

ROOT_URLCONF = "audiosite.urls"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

ASGI_APPLICATION = "audiosite.asgi.application"

DATABASE_URL = env_url(
    "DATABASE_URL",
    f"sqlite:///{VAR_DIR / 'audiosite.sqlite3'}",
    ("sqlite", "postgres", "postgresql", "pgsql"),
)
assert DATABASE_URL is not None  # it has a default
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (web, worker) share the file. Write transactions take the write lock when
    # they begin (IMMEDIATE) and wait up to 20 s for it: a deferred transaction that reads first and
    # then upgrades to a write fails at once with "database is locked" when another process writes,
    # whatever the timeout (SQLite cannot wait there without risking a deadlock). WAL lets readers go
    # on beside the writer.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        timeout=20, transaction_mode="IMMEDIATE", init_command="PRAGMA journal_mode=WAL;")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_url("REDIS_URL", None, ("redis", "rediss", "unix"))

AUTH_PASSWORD_VALIDATORS: list[dict] = []
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# Uploads: Django must not refuse a body before our own size check answers
# with the documented 413; ``max_request_body_bytes`` (server.json) is the cap.
DATA_UPLOAD_MAX_MEMORY_SIZE = None
FILE_UPLOAD_MAX_MEMORY_SIZE = 16 * 1024 * 1024

REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "audiosite.errors.drf_exception_handler",
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_PARSER_CLASSES": [
        "audiosite.validation.JSONParser",
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}

# Celery: Redis is the broker and the result store. Tasks pass ids and Redis
# keys, never audio. Prefetch 1: a GPU task is long.
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DIRECT = True
CELERY_TASK_DEFAULT_QUEUE = "gpu"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"only_500": {"()": "audiosite.errors.OnlyServerErrors"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"},
                 "server_errors": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["only_500"]}},
    "root": {"handlers": ["console"], "level": "INFO"},
    # django.request logs every 4xx/503 too; only real 500s (with their traceback) are
    # worth a line. 500s inside DRF views are logged by audiosite.errors.drf_exception_handler.
    "loggers": {"django.request": {"level": "ERROR", "handlers": ["server_errors"], "propagate": False},
                "faster_whisper": {"level": "WARNING"}},
}
