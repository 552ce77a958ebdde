"""Django settings for audiosite: one file, infrastructure from the environment.

Only infrastructure lives here (database, Redis, secret key, paths). What the
server serves lives in ``server.json`` (see ``audiosite.serverconfig``).

Environment variables (all optional):

``DATABASE_URL``
    Any URL ``dj-database-url`` understands. Default: an SQLite file at
    ``var/audiosite.sqlite3`` inside the checkout.
``REDIS_URL``
    ``redis://[:password@]host:port/db``, ``rediss://…`` or
    ``unix://[:password@]/path/redis.sock?db=N``. Default: unset; ``manage.py
    serve`` then starts a private Redis server (``audiosite.embedded_redis``:
    unix socket and password) and sets it for its children. Any other process
    that needs Redis without it fails with ``ImproperlyConfigured``. Celery's
    broker gets the same server in kombu's spelling (``redis+socket://`` for a
    socket).
``AUDIOSITE_SECRET_KEY``
    Django secret key. Default: a random key generated once into
    ``var/secret_key`` (mode 0600). With ``DEBUG`` off a known placeholder
    (``change-me``…), a key shorter than 32 characters or with fewer than 5
    distinct characters, and an empty key file are refused at start-up
    (``ImproperlyConfigured``), in every process.
``AUDIOSITE_DEBUG``
    ``1``/``0``. Default ``0``.
``AUDIOSITE_VAR_DIR``
    Where the secret key, the SQLite file and the embedded Redis live.
    Default ``var/`` in the checkout, created with mode 0700.

``ALLOWED_HOSTS`` is not read from the environment: the web process sets it
at start from ``server.json`` (``host`` and ``allowed_hosts``, see
``audiosite.serverconfig.ServerConfig.allowed_host_names``); the value below
is the default bind's names, for processes that never serve HTTP.

The environment is read through ``audiosite.env`` (which fails loudly, ``ImproperlyConfigured``, on a
malformed value instead of falling back silently).
"""
from __future__ import annotations

import os
import secrets
import warnings
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from audiosite.embedded_redis import EmbeddedRedis, kombu_broker_url
from audiosite.env import env_bool, env_path, env_str, env_url
from audiosite.redis_sockets import redis_socket_kwargs

BASE_DIR = Path(__file__).resolve().parent.parent


# Values that ship in examples and must never sign a production session (compared lower-cased).
PLACEHOLDER_SECRET_KEYS = frozenset({
    "change-me", "changeme", "change_me", "change-this", "replace-me", "secret", "secret-key", "secretkey",
    "insecure", "django-insecure", "dev", "development", "test", "password", "audiosite",
})
SECRET_KEY_MIN_CHARS = 32
SECRET_KEY_MIN_DISTINCT_CHARS = 5
SECRET_KEY_HINT = ("generate one with: python -c 'import secrets; print(secrets.token_urlsafe(50))'")


def secret_key_problem(key: str) -> str | None:
    """Why ``key`` must not be a production secret key, or None when it is acceptable.

    Refused: empty, a known placeholder (``PLACEHOLDER_SECRET_KEYS``, or Django's
    ``django-insecure-`` prefix), fewer than ``SECRET_KEY_MIN_CHARS`` characters,
    or fewer than ``SECRET_KEY_MIN_DISTINCT_CHARS`` distinct characters.
    """
    if not key:
        return "is empty"
    if key.lower() in PLACEHOLDER_SECRET_KEYS or key.lower().startswith("django-insecure"):
        return f"is the placeholder {key!r}"
    if len(key) < SECRET_KEY_MIN_CHARS:
        return f"is {len(key)} characters long (at least {SECRET_KEY_MIN_CHARS} are needed)"
    if len(set(key)) < SECRET_KEY_MIN_DISTINCT_CHARS:
        return f"has fewer than {SECRET_KEY_MIN_DISTINCT_CHARS} distinct characters"
    return None


def _secret_key(var_dir: Path, debug: bool) -> str:
    """``AUDIOSITE_SECRET_KEY``, else the key in ``<var_dir>/secret_key`` (generated once, mode 0600).

    Raises:
        ImproperlyConfigured: ``debug`` is off and the key (from either source) fails
            :func:`secret_key_problem`.
    """
    explicit = env_str("AUDIOSITE_SECRET_KEY")
    key_file = var_dir / "secret_key"
    if explicit:
        key, source = explicit, "AUDIOSITE_SECRET_KEY"
    else:
        var_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        source = str(key_file)
        try:
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = key_file.read_text().strip()
        else:
            key = secrets.token_urlsafe(50)
            with os.fdopen(fd, "w") as handle:
                handle.write(key)
    problem = secret_key_problem(key)
    if problem and not debug:
        raise ImproperlyConfigured(
            f"refusing to start: the secret key ({source}) {problem}. Set AUDIOSITE_SECRET_KEY to a random "
            f"secret of at least {SECRET_KEY_MIN_CHARS} characters ({SECRET_KEY_HINT}), or unset it to use a "
            f"key generated into {key_file}; AUDIOSITE_DEBUG=1 lifts this check for development only")
    return key


VAR_DIR = env_path("AUDIOSITE_VAR_DIR", BASE_DIR / "var")
DEBUG = env_bool("AUDIOSITE_DEBUG", False)
SECRET_KEY = _secret_key(VAR_DIR, DEBUG)
# The default bind's names (127.0.0.1). The web process replaces this list at start with
# ServerConfig.allowed_host_names() (audiosite.asgi); never "*" (DNS rebinding).
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

# Not "daphne": its app only swaps in an ASGI ``runserver`` (not how audiosite runs: ``manage.py serve``
# starts daphne through audiosite.web) and, to do so, imports the Twisted server into every process
# (serve, the workers, each manage.py command): 0.45 s of start-up each (docs/benchmarks.md).
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "axes",
    "registry",
    "inference",
    "ui",
    # The tools (management commands only; the request path imports neither): the validation gate,
    # the benchmarks.
    "gate",
    "bench",
]

MIDDLEWARE = [
    # The two header middlewares come first (outermost), so responses made inside the chain (a
    # refused Host from CommonMiddleware, a CSRF failure) carry the headers too.
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Static files (/static/: the UI's and the admin's) in production, without a separate web server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # Login throttling (django-axes): turns a lockout into the 429 page; last, as its docs ask.
    "axes.middleware.AxesMiddleware",
]
# MIDDLEWARE serves the paths below (the admin, the future /ui/, static files) through Django's own
# ASGIHandler. Every other path (the API) goes through audiosite.http.handler.ApiHandler with
# API_MIDDLEWARE: async-only middleware, so a status or inference request makes no thread hop. The
# API authenticates sessions and tokens itself (registry.authentication), asynchronously.
FULL_STACK_PATH_PREFIXES = ("/admin/", "/ui/")
API_MIDDLEWARE = [
    "audiosite.http.middleware.SecurityOnLoop",
    "audiosite.http.middleware.FrameOptionsOnLoop",
    "audiosite.http.middleware.AllowedHostOnLoop",
    "audiosite.http.middleware.CommonOnLoop",
]

# Security headers on every response, API and admin alike (SecurityMiddleware and
# XFrameOptionsMiddleware, or their on-loop wrappers in API_MIDDLEWARE). Django's defaults, written
# out because the tests and docs/operations.md rely on them.
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"

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

# REDIS_URL_GIVEN: the environment's REDIS_URL (serve starts a Redis of its own without one). Every other
# process without one uses the embedded Redis of a `serve` running on this var folder, if any, so that
# `manage.py unload_model`, `load_models`, `sync_config` ... work beside it with no setup.
REDIS_URL_GIVEN = env_url("REDIS_URL", None, ("redis", "rediss", "unix"))
REDIS_URL = REDIS_URL_GIVEN or EmbeddedRedis.under(VAR_DIR).running_url()

# The Channels layer lives on the deployment's Redis (the embedded one too: its unix-socket URL with
# the password, which redis-py's from_url reads); without Redis (management commands) an in-memory layer.
# No socket timeout: redis-py 8 defaults to 5 s, and a consumer's receive blocks in BZPOPMIN for up to
# channels-redis's brpop_timeout (5 s), which then failed as a "Timeout reading" and closed the socket 1011.
def channel_layer_config(redis_url: str) -> dict:
    """The ``CONFIG`` of the Channels Redis layer on ``redis_url`` (also used by ``serve`` to reach
    the web processes' consumers at shutdown)."""
    return {"hosts": [{"address": redis_url, "socket_timeout": None, **redis_socket_kwargs(redis_url)}],
            "prefix": "as:asgi"}


CHANNEL_LAYERS = {"default": {"BACKEND": "audiosite.channel_layer.RetryingRedisChannelLayer",
                              "CONFIG": channel_layer_config(REDIS_URL)}
                  if REDIS_URL else {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Passwords set through the admin, createsuperuser or changepassword: Django's four validators
# (at least 12 characters, not like the user's name or e-mail, not a common password, not all digits).
AUTH_PASSWORD_VALIDATORS: list[dict] = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Login throttling (django-axes, database handler: every web process sees the same count). After
# AXES_FAILURE_LIMIT wrong passwords for one user name from one client address, that pair is locked
# out for AXES_COOLOFF_TIME: every login of it, right or wrong, gets 429 (the UI's and the admin's
# login pages alike). Locking the pair rather than the address alone keeps one client behind a shared
# proxy address from locking everyone out; a success resets the count. An operator lifts a lockout
# early with `manage.py axes_reset_username <name>` or in the admin ("Access attempts").
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "ui.views.login_locked"
AXES_VERBOSE = False
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# WhiteNoise serves the files of the apps' static/ folders straight from the finders (scanned once at
# start), so `serve` needs no collectstatic step; after `collectstatic` it serves STATIC_ROOT as well.
WHITENOISE_USE_FINDERS = True
# STATIC_ROOT exists only after a collectstatic; WhiteNoise would warn at every start without it.
warnings.filterwarnings("ignore", message="No directory at: ", category=UserWarning)
WHITENOISE_MAX_AGE = 3600

# The browser UI (ui/): Django's session login.
LOGIN_URL = "/ui/login/"
LOGIN_REDIRECT_URL = "/ui/"
LOGOUT_REDIRECT_URL = "/ui/"

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
        "audiosite.input_checks.JSONParser",
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}

# Celery: Redis is the broker and the result store. Tasks pass ids and Redis
# keys, never audio. Prefetch 1: a GPU task is long.
CELERY_BROKER_URL = kombu_broker_url(REDIS_URL) if REDIS_URL else None
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DIRECT = True
CELERY_TASK_DEFAULT_QUEUE = "gpu"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# A worker's BRPOP on its task queues returns every 0.2 s while idle (kombu's default: 1 s): a warm
# shutdown closes that channel only once the BRPOP in flight has answered, so each worker stop
# waited up to a second for nothing (docs/benchmarks.md). Five cheap commands a second per idle
# worker; fractional timeouts need Redis 6 or newer, as the run queue's BRPOP already does.
# The broker's connections get the same TCP options as every other Redis connection (a silent network
# fault fails their commands within seconds instead of minutes; audiosite/redis_sockets.py).
CELERY_BROKER_TRANSPORT_OPTIONS = {"polling_interval": 0.2, **(redis_socket_kwargs(REDIS_URL) if REDIS_URL else {})}

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
    # A foreign Host header is the client's problem (400 in the API shape, see audiosite.http.middleware);
    # Django would log each one as an ERROR with a traceback.
    "loggers": {"django.request": {"level": "ERROR", "handlers": ["server_errors"], "propagate": False},
                "django.security.DisallowedHost": {"handlers": [], "propagate": False},
                "faster_whisper": {"level": "WARNING"}},
}
