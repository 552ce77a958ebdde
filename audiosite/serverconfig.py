"""Server configuration: ``server.json`` plus command-line overrides.

Parsing uses pydantic (strict types, unknown keys forbidden) for the shape and
``jsonschema`` (the option schemas in ``model_specs/<family>.json``) for the
per-family option blocks. Every problem is reported at once, each message
naming the key and, for model entries, the model id.

Keys documented in API.md that this version does not implement yet
(the browser UI, CORS, a voice directory, spec overrides, live ingest)
are refused with a message that says so, instead of being accepted and
silently ignored.

Errors:
    ConfigError: raised by :func:`parse_config` / :func:`load_config` with the
    list of problems (``.problems``).
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from audiosite.env import env_bool, env_json, env_str
from inference import specs
from inference.backend import resolve_backend

# Keys of API.md that later issues implement; refused until then.
NOT_YET_SUPPORTED_TOP = {
    "cors_origins": "CORS",
    "voice_dir": "speech synthesis voices",
    "model_spec_override": "spec overrides",
}
NOT_YET_SUPPORTED_MODEL: dict[str, str] = {}

MAX_BUSY_TIMEOUT_MS = 2**31 - 1  # about 24.8 days; larger values are refused, not overflowed
# 192 MiB: one decode of the longest default input (1800 s of 16 kHz float32, 115.2 MB) fits, two do not,
# and about 85 MB stay for shorter ones beside it (docs/operations.md, "The decode budget").
DEFAULT_DECODE_BUDGET_BYTES = 192 * 1024 * 1024
MIN_RUN_MS = 100
"""The smallest ``max_run_ms`` a registration may set (ms)."""
MAX_BATCH = 64
"""The largest ``max_batch`` a registration may set (requests per session call)."""
MAX_BATCH_WINDOW_MS = 10000
"""The longest ``batch_window_ms`` a registration may set (ms): every lone run of a batching model waits
this long before it runs, so a longer window only adds latency."""
DEFAULT_MAX_RUN_MS = 120000
"""A run's deadline (ms) when its registration sets no ``max_run_ms``: for up to
``RUN_DEADLINE_AUDIO_S`` of input, scaled for longer inputs. Two minutes per 30 s of audio leaves a
wide margin over a healthy run of the shipped models on one CPU thread (seconds), so only a wedged
run meets it."""
RUN_DEADLINE_AUDIO_S = 30.0
"""Input length (s of audio; for speech, ``RUN_DEADLINE_TEXT_CHARS`` characters) that ``max_run_ms``
covers; a longer input's deadline grows in proportion (R3.6)."""
RUN_DEADLINE_TEXT_CHARS = 500
"""Characters of speech input that ``max_run_ms`` covers (about 30 s of speech)."""

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config" / "server.json"

# Host names a loopback-bound server answers to (Django's ALLOWED_HOSTS spelling: IPv6 in brackets).
LOOPBACK_HOST_NAMES = ("127.0.0.1", "localhost", "[::1]")
# Binds that listen on every interface: the names clients use cannot be guessed and must be listed.
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", "[::]"})
# One ALLOWED_HOSTS pattern: "*", a name, ".name" (the name and its subdomains), an IPv4 address
# or a bracketed IPv6 address. No port, scheme, path or space.
_HOST_PATTERN = re.compile(r"^(\*|\.?[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\])$")


class ConfigError(Exception):
    """The configuration is invalid; ``problems`` lists one message per fault."""

    def __init__(self, problems: list[str], source: str = "server config"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class VoicePreset(_Strict):
    """A speech voice under another name (``voice_presets``): the ``voice`` it stands for and the
    request ``options`` it sets (checked against the family's ``request_options``)."""

    voice: str = Field(min_length=1, max_length=128)
    options: dict[str, Any] = Field(default_factory=dict)


class ModelConfig(_Strict):
    """One entry of ``models``: a registered model id and how to load it.

    ``busy_timeout_ms`` is this model's admission-timeout ceiling in
    milliseconds (R3.1); None means "use the server's". ``lazy`` None means
    "use the server's ``lazy_load``". ``mode`` is the mode whose admitted counts bound ``slots``
    (R9.2); ``modes`` the modes the registration serves (None: its family's ``modes``; a stream is
    refused by a registration without ``streaming``, and served at most at the streaming mode's
    admitted count, ``inference.specs.stream_slot_count``).
    ``max_run_ms`` is a run's deadline in
    milliseconds for up to ``RUN_DEADLINE_AUDIO_S`` of input (longer inputs
    scale it, ``inference.worker.work.run_deadline_s``); None means
    ``DEFAULT_MAX_RUN_MS`` (R3.6).
    ``max_batch`` (None = 1: no batching) is how many granted runs of this model one session call may
    serve, ``batch_window_ms`` (None = 0) how long the first of them waits for others
    (``inference.worker.batching``); above 1 the family must serve the ``batch`` mode
    (``inference.specs.check_model_entry``).
    """

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    family: str = Field(min_length=1, max_length=64)
    path: str | None = Field(default=None, max_length=1024)
    task: str | None = Field(default=None, max_length=64)
    mode: Literal["offline", "streaming"] = "offline"
    modes: list[Literal["offline", "streaming", "batch"]] | None = Field(default=None, min_length=1, max_length=3)
    lazy: bool | None = None
    slots: Any = None  # checked by specs.slots_problems (parallel runtime only)
    busy_timeout_ms: int | None = Field(default=None, ge=0, le=MAX_BUSY_TIMEOUT_MS)
    max_run_ms: int | None = Field(default=None, ge=MIN_RUN_MS, le=MAX_BUSY_TIMEOUT_MS)
    max_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    batch_window_ms: int | None = Field(default=None, ge=0, le=MAX_BATCH_WINDOW_MS)
    load_options: dict[str, Any] = Field(default_factory=dict)
    session_options: dict[str, Any] = Field(default_factory=dict)
    default_request_options: dict[str, Any] = Field(default_factory=dict)
    voice_presets: dict[str, VoicePreset] = Field(default_factory=dict)
    default_voice_preset: str | None = None


class LiveIngest(_Strict):
    """Limits of a live (WebSocket) transcription session (``live_ingest``; API.md).

    ``idle_timeout_ms``: no client event for this long ends the session (default 30 s);
    ``total_timeout_ms``: a session lasts at most this long (default 10 min); both close it with
    a final ``error`` event and code 1000. ``max_chunk_bytes``: the largest WebSocket message
    accepted (default 1 MiB, about 16 s of 24 kHz PCM in base64); ``max_body_bytes``: the most
    uncommitted audio (s16le bytes at the client's rate) the input buffer holds (default 16 MiB,
    about 5.8 min at 24 kHz, OpenAI's 15 MiB per event rounded up); past either the session ends
    with a final ``error`` event and code 1009 (message too big).

    Turns (each holds a slot of the model while it is spoken, R8.3): ``turn_audio_timeout_ms``: a
    server-VAD turn that gets no ``input_audio_buffer.append`` for this long is committed (default 2 s;
    a client that stops sending mid-speech must not keep the slot); ``max_turn_ms``: a turn that
    reaches this much audio is committed (default 30 s, Whisper's window; speech that goes on opens
    the next turn); ``max_pending_turns``: the most turns of one session not yet transcribed (being
    spoken, waiting for the model or decoding; default 3); ``max_turns_per_session`` (default 1000).
    A turn past either cap is refused with an ``error`` event and nothing is queued.
    """

    idle_timeout_ms: int = Field(default=30000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    total_timeout_ms: int = Field(default=600000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_chunk_bytes: int = Field(default=1024 * 1024, ge=1024)
    turn_audio_timeout_ms: int = Field(default=2000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    max_turn_ms: int = Field(default=30000, ge=1000, le=MAX_BUSY_TIMEOUT_MS)
    max_pending_turns: int = Field(default=3, ge=1, le=100)
    max_turns_per_session: int = Field(default=1000, ge=1)


OPENAI_MODEL_ALIASES = {
    "whisper-1": "asr", "gpt-4o-transcribe": "asr", "gpt-4o-mini-transcribe": "asr",
    "tts-1": "tts", "tts-1-hd": "tts", "gpt-4o-mini-tts": "tts",
}
"""OpenAI's model names of its audio API (platform.openai.com/docs/api-reference/audio) → the task whose
default model answers to them (:meth:`ServerConfig.default_model`), so an OpenAI client works unchanged."""


class ServerConfig(_Strict):
    """The whole server configuration with API.md defaults (times in ms, sizes in bytes)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    device: int = Field(default=0, ge=0)
    threads: int = Field(default=1, ge=1, le=64)
    lazy_load: bool = False
    busy_timeout_ms: int = Field(default=300000, ge=0, le=MAX_BUSY_TIMEOUT_MS)
    shutdown_timeout_ms: int = Field(default=30000, ge=0)
    worker_restart_delay_ms: int = Field(default=1000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """serve: delay before restarting a worker that exited (first time; doubles per quick exit)."""
    worker_restart_max_delay_ms: int = Field(default=30000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """serve: ceiling of that doubling delay."""
    web_stall_timeout_ms: int = Field(default=5000, ge=2000, le=MAX_BUSY_TIMEOUT_MS)
    """serve: a web process whose event loop sent no heartbeat for this long is killed and restarted
    (``audiosite.heartbeat``, ``audiosite.supervision.WebSupervisor``; restart delays as for workers)."""
    lease_ttl_ms: int = Field(default=30000, ge=1000)
    max_request_body_bytes: int = Field(default=104857600, ge=1024)
    request_header_timeout_ms: int = Field(default=10000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """A request whose headers are not all in this long after its first byte (or the connection's
    start) gets 408 ``request_timeout`` and its connection is closed (``audiosite.http.daphne_server``)."""
    request_body_timeout_ms: int = Field(default=120000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """A request whose body is not all in this long after its headers gets 408 ``request_timeout``
    and its connection is closed (the default admits a ``max_request_body_bytes`` body at 0.9 MB/s)."""
    stream_write_timeout_ms: int = Field(default=30000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """A streamed response (speech, SSE) whose client has read nothing for this long while the web
    process's send buffer for it is full is dropped, and its lease released (``audiosite.http.daphne_server``)."""
    max_audio_seconds: float = Field(default=1800.0, gt=0, le=86400)
    max_decoded_bytes_in_flight: int = Field(default=DEFAULT_DECODE_BUDGET_BYTES, ge=0)
    """Decoded audio one web process may hold at once (``inference.runtime.decoding``); 0 = no limit."""
    media_roots: list[str] = Field(default_factory=list)
    wyoming_max_connections: int = Field(default=32, ge=1, le=4096)
    """Connections ``manage.py wyoming`` serves at once (``inference.wyoming_server``); one more gets an
    ``error`` event ``too_many_connections``. Each buffers at most one transcription's audio."""
    refuse_connections_when_unready: bool = False
    """A web process closes its listening ports (and its idle keep-alive connections) while its Redis
    subscription is lost and once it drains, so that a proxy passes requests to another web process
    (``audiosite.http.port_gate``); false: it keeps accepting and answers 503 ``redis_unavailable`` or
    ``shutting_down``."""
    model_processes: bool = True
    """True (the default): each loaded model's sessions run in a process of its own
    (``inference.worker.pool_process``): a crash costs only that model, a run past its deadline is
    stopped, an unload returns the memory. False: pools run in the worker process (no run deadlines; a
    crash ends the worker; about 45 MB less per loaded model, docs/benchmarks.md)."""
    ui: bool = True
    """The browser UI at ``/ui/`` (``/`` redirects there); false: both answer 404."""
    ui_anonymous: Literal["status", "none"] = "status"
    """What the UI shows a visitor who is not logged in: ``status`` (the live dashboard, read only)
    or ``none`` (every UI page sends them to the login page, the status stream refuses them)."""
    ui_management: bool = False
    allowed_hosts: list[str] = Field(default_factory=list)
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser origins (``scheme://host[:port]``, ``scheme://.domain`` for a domain and its subdomains,
    or ``*``) whose pages may open the WebSockets (``/v1/realtime``, ``/ui/ws/status``) besides the
    server's own origin; a handshake with any other ``Origin`` gets 403 (one without ``Origin``, from a
    program rather than a browser, is accepted). Default: same origin only."""
    max_loaded_models: int = Field(default=0, ge=0)
    eviction_policy: Literal["recent_use", "lru"] = "recent_use"
    """How ``max_loaded_models`` picks a model to unload (R6.1, ``inference.services.loading``):
    ``recent_use`` evicts the idle model with the fewest recent requests, only once it has been
    loaded ``min_residency_ms`` and only when it has fewer recent requests than the model asking;
    ``lru`` (the policy before it) evicts the least recently used idle model at once."""
    use_half_life_ms: int = Field(default=10000, ge=100, le=MAX_BUSY_TIMEOUT_MS)
    """Half-life of a model's recent-use count (each admitted request counts 1, halving every
    ``use_half_life_ms``); used by ``recent_use`` eviction."""
    min_residency_ms: int = Field(default=2000, ge=0, le=MAX_BUSY_TIMEOUT_MS)
    """``recent_use`` eviction: a model loaded less than this long ago is not evicted."""
    idle_unload_ms: int = Field(default=0, ge=0)
    min_free_memory_mb: int = Field(default=0, ge=0)
    live_ingest: LiveIngest = Field(default_factory=LiveIngest)
    models: list[ModelConfig] = Field(default_factory=list)
    default_models: dict[str, str] = Field(default_factory=dict)
    """The model a task's OpenAI names stand for, by task (``{"asr": "whisper-tiny.en", "tts": "piper-joe"}``);
    a task not named here: the first entry of ``models`` with that task (:meth:`default_model`)."""
    model_aliases: dict[str, str | None] = Field(default_factory=dict)
    """Other names of models, ``{alias: model id}``, on top of :data:`OPENAI_MODEL_ALIASES` (an alias set to
    null here is removed). A registered model of the same id always wins over an alias."""
    runtime: Literal["legacy", "parallel"] = "legacy"
    """Not a key of the file: chosen by ``--parallel-jobs`` / ``AUDIOSITE_PARALLEL_JOBS`` and
    resolved once by :func:`parse_config` (R1.3, R1.4)."""

    @property
    def residency_limited(self) -> bool:
        """True when a residency or memory limit is set: cold loads then pass one guard (R6.6)."""
        return bool(self.max_loaded_models or self.min_free_memory_mb)

    def allowed_host_names(self) -> list[str]:
        """The ``Host`` names the web process answers to (Django's ``ALLOWED_HOSTS``), in order, no duplicates.

        The bound ``host`` contributes its own names: a loopback address or
        ``localhost`` gives ``127.0.0.1``, ``localhost`` and ``[::1]`` (plus the
        address itself); a wildcard bind (``0.0.0.0``, ``::``) gives the loopback
        names (``serve`` probes ``/health`` through 127.0.0.1); any other
        address or name gives itself (IPv6 in brackets). ``allowed_hosts`` is
        appended as written. A browser page on another origin that rebinds its
        DNS name to this server sends its own name in ``Host`` and gets 400.
        """
        bound = _bracketed(self.host)
        names: list[str] = []
        if self.host in WILDCARD_BINDS:
            names += LOOPBACK_HOST_NAMES
        elif self.host == "localhost" or _is_loopback(self.host):
            names += [*LOOPBACK_HOST_NAMES, bound]
        else:
            names.append(bound)
        names += [_bracketed(name) for name in self.allowed_hosts]
        return list(dict.fromkeys(names))

    def default_model(self, task: str) -> str | None:
        """The id of ``task``'s default model: ``default_models[task]``, else the first entry of ``models``
        whose task (given, or its family's default) is ``task``, else None."""
        if task in self.default_models:
            return self.default_models[task]
        for entry in self.models:
            if (entry.task or specs.default_task(entry.family)) == task:
                return entry.id
        return None

    def aliases(self) -> dict[str, str]:
        """Every model alias, ``{alias: model id}``: :data:`OPENAI_MODEL_ALIASES` resolved through
        :meth:`default_model`, then ``model_aliases`` (null removes one); aliases of a task without a
        default model are left out."""
        resolved = {alias: self.default_model(task) for alias, task in OPENAI_MODEL_ALIASES.items()}
        resolved.update(self.model_aliases)
        return {alias: target for alias, target in resolved.items() if target}

    def model(self, model_id: str) -> ModelConfig | None:
        """Return the entry with ``model_id`` or None."""
        for entry in self.models:
            if entry.id == model_id:
                return entry
        return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    """``host`` as Django compares it: a bare IPv6 address gets brackets, anything else is unchanged."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    return f"[{address}]" if address.version == 6 else host


def _allowed_hosts_problems(config: ServerConfig) -> list[str]:
    problems = []
    for name in config.allowed_hosts:
        if not _HOST_PATTERN.match(_bracketed(name)):
            problems.append(f"key 'allowed_hosts': {name!r} is not a host name, '.domain', IP address or '*' "
                            "(no scheme, port or path)")
    if config.host in WILDCARD_BINDS and not config.allowed_hosts:
        problems.append(f"key 'allowed_hosts': host {config.host!r} listens on every interface; list the names "
                        "clients use to reach this server (e.g. [\"audio.example.com\"]); loopback names are "
                        "always allowed")
    return problems


def _allowed_origins_problems(config: ServerConfig) -> list[str]:
    problems = []
    for origin in config.allowed_origins:
        if origin == "*":
            continue
        try:
            parsed = urlsplit(origin)
            valid = (parsed.scheme in ("http", "https") and bool(parsed.hostname) and (parsed.port or 1) > 0
                     and not (parsed.path or parsed.query or parsed.fragment or parsed.username or parsed.password))
        except ValueError:  # a port that is not a number in 0-65535
            valid = False
        if not valid:
            problems.append(f"key 'allowed_origins': {origin!r} is not an origin such as 'https://app.example.com', "
                            "'https://app.example.com:8443', 'https://.example.com' or '*' (no path)")
    return problems


def slot_count(slots: int | None, runtime: str) -> int:
    """Slots the scheduler admits for a model configured with ``slots``: ``slots`` (1 when unset)
    on the parallel runtime, always 1 on the legacy runtime (R1.1, R1.3)."""
    return (slots or 1) if runtime == "parallel" else 1


def _where(loc: tuple, data: dict) -> str:
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        index = loc[1]
        model_id = None
        models = data.get("models")
        if isinstance(models, list) and index < len(models) and isinstance(models[index], dict):
            model_id = models[index].get("id")
        rest = ".".join(str(part) for part in loc[2:])
        who = f"models[{index}]" + (f" (id {model_id!r})" if model_id is not None else "")
        return f"{who}: key {rest!r}" if rest else who
    return "key " + repr(".".join(str(part) for part in loc))


def _check_unsupported(data: dict, problems: list[str], parallel: bool) -> None:
    for key, what in NOT_YET_SUPPORTED_TOP.items():
        if key in data:
            problems.append(f"key {key!r}: {what} is not supported by this version of audiosite")
    models = data.get("models")
    if isinstance(models, list):
        for index, entry in enumerate(models):
            if not isinstance(entry, dict):
                continue
            who = f"models[{index}] (id {entry.get('id')!r})"
            for key, what in NOT_YET_SUPPORTED_MODEL.items():
                if key in entry:
                    problems.append(f"{who}: key {key!r}: {what} is not supported by this version of audiosite")
            if "slots" in entry and not parallel:
                problems.append(
                    f"{who}: key 'slots': slots requires --parallel-jobs; the legacy runtime serves one "
                    "session per model and refuses any explicit slots, including 1 and null (R1.2)"
                )


def parse_config(data: Any, source: str = "server config", parallel: bool = False,
                 backend_resolver=None) -> ServerConfig:
    """Validate a decoded ``server.json`` document.

    Args:
        data: the decoded JSON (must be an object).
        source: a name for messages (usually the file path).
        parallel: the parallel runtime (``--parallel-jobs``) is selected:
            ``slots`` is then allowed (R1.3, R9) instead of refused (R1.2).
        backend_resolver: maps the configured backend ('auto'/'cpu'/'cuda') to
            'cpu' or 'cuda' for the capacity checks (default:
            ``inference.backend.resolve_backend``).

    Returns:
        The validated ``ServerConfig``.

    Raises:
        ConfigError: unknown keys, wrong types, out-of-range values, duplicate
            model ids, unknown family/task/mode, invalid option blocks, or an
            explicit ``slots`` (legacy runtime, R1.2). Lists every problem.
    """
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a JSON object"], source)
    problems: list[str] = []
    _check_unsupported(data, problems, parallel)
    cleaned = _supported_keys(data, problems, parallel)
    config = _validated(cleaned, data, problems)
    if config is not None:
        problems.extend(_model_problems(config, data, parallel, backend_resolver))
        problems.extend(_server_problems(config))
    if problems or config is None:
        raise ConfigError(problems, source)
    return config


def _supported_keys(data: dict, problems: list[str], parallel: bool) -> dict:
    """A copy of ``data`` without the keys this version refuses (``NOT_YET_SUPPORTED_*``, ``runtime``,
    a model's ``slots`` on the legacy runtime) and with ``runtime`` set from ``parallel``; a ``runtime``
    key adds a problem to ``problems`` (the others were reported by :func:`_check_unsupported`)."""
    if "runtime" in data:
        problems.append("key 'runtime': unknown key (the runtime is chosen with --parallel-jobs or "
                        "AUDIOSITE_PARALLEL_JOBS=1)")
    cleaned = {k: v for k, v in data.items() if k not in NOT_YET_SUPPORTED_TOP and k != "runtime"}
    cleaned["runtime"] = "parallel" if parallel else "legacy"
    if isinstance(cleaned.get("models"), list):
        cleaned["models"] = [
            {k: v for k, v in m.items() if k not in NOT_YET_SUPPORTED_MODEL and (parallel or k != "slots")}
            if isinstance(m, dict) else m
            for m in cleaned["models"]
        ]
    return cleaned


def _validated(cleaned: dict, data: dict, problems: list[str]) -> ServerConfig | None:
    """``cleaned`` as a :class:`ServerConfig`, or None with pydantic's errors added to ``problems``, each
    located in the document as written (``data``, :func:`_where`); an extra key is an "unknown key"."""
    try:
        return ServerConfig.model_validate(cleaned)
    except ValidationError as exc:
        for err in exc.errors():
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                message = "unknown key"
            problems.append(f"{_where(err['loc'], data)}: {message}")
    return None


def _model_problems(config: ServerConfig, data: dict, parallel: bool, backend_resolver) -> list[str]:
    """Problems of the model entries, in file order: duplicate ids, each entry's own checks
    (``specs.check_model_entry``) and, on the parallel runtime, an explicit ``slots`` (``data``'s entry)
    beyond what the family, task and mode allow on the resolved backend (``specs.slots_problems``) and
    a ``max_batch`` above the admitted batch sizes (``specs.batch_size_problem``; ``backend_resolver``
    default ``inference.backend.resolve_backend``, called only for those two checks)."""
    problems: list[str] = []
    seen: set[str] = set()
    for index, entry in enumerate(config.models):
        who = f"models[{index}] (id {entry.id!r})"
        if entry.id in seen:
            problems.append(f"{who}: duplicate model id {entry.id!r}")
        seen.add(entry.id)
        entry_problems = specs.check_model_entry(entry.model_dump())
        problems.extend(f"{who}: {p}" for p in entry_problems)
        raw = data["models"][index]
        if parallel and not entry_problems and ("slots" in raw or (entry.max_batch or 1) > 1):
            backend = (backend_resolver or resolve_backend)(config.backend)
            task = entry.task or specs.default_task(entry.family)
            if "slots" in raw:
                problems.extend(f"{who}: {p}" for p in specs.slots_problems(
                    entry.family, task, entry.mode, raw["slots"], backend))
            batch_problem = specs.batch_size_problem(entry.family, task, entry.max_batch, backend)
            if batch_problem:
                problems.append(f"{who}: {batch_problem}")
    return problems


def _server_problems(config: ServerConfig) -> list[str]:
    """Problems across the server keys: an empty model list without ``ui_management``, the allowed hosts
    and origins, a restart delay ceiling below its start, a relative media root."""
    problems: list[str] = []
    if not config.models and not config.ui_management:
        problems.append("key 'models': the list may be empty only with ui_management on (models are then "
                        "registered through POST /v1/models/load)")
    problems.extend(_allowed_hosts_problems(config))
    problems.extend(_allowed_origins_problems(config))
    if config.worker_restart_max_delay_ms < config.worker_restart_delay_ms:
        problems.append(f"key 'worker_restart_max_delay_ms': {config.worker_restart_max_delay_ms} is below "
                        f"worker_restart_delay_ms={config.worker_restart_delay_ms}")
    for root in config.media_roots:
        if not os.path.isabs(root):
            problems.append(f"key 'media_roots': {root!r} is not an absolute path")
    return problems


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None,
                parallel: bool | None = None) -> ServerConfig:
    """Read, merge and validate the server configuration.

    Args:
        path: the JSON file; default ``AUDIOSITE_CONFIG`` or ``config/server.json``.
        overrides: top-level keys that replace the file's (command-line flags);
            default: the JSON object in ``AUDIOSITE_CONFIG_OVERRIDES``, which
            ``manage.py serve`` sets for its children.
        parallel: runtime selection; default :func:`parallel_jobs`.

    Raises:
        ConfigError: unreadable file, invalid JSON, or any problem of
            :func:`parse_config`.
    """
    path = Path(path or env_str("AUDIOSITE_CONFIG") or DEFAULT_CONFIG_PATH)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}"], str(path)) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError([f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"], str(path)) from exc
    except ValueError as exc:  # an integer literal over Python's 4300-digit conversion limit
        raise ConfigError([f"invalid JSON: {exc}"], str(path)) from exc
    if overrides is None:
        overrides = env_json("AUDIOSITE_CONFIG_OVERRIDES", {})
    if parallel is None:
        parallel = parallel_jobs()
    if overrides and isinstance(data, dict):
        parse_config(data, str(path), parallel)  # the file must be valid on its own, too
        data = {**data, **overrides}
    return parse_config(data, str(path), parallel)


def parallel_jobs() -> bool:
    """True when ``AUDIOSITE_PARALLEL_JOBS`` selects the parallel runtime (set by ``serve --parallel-jobs``).

    Raises:
        ConfigError: the variable holds something other than a boolean word.
    """
    try:
        return env_bool("AUDIOSITE_PARALLEL_JOBS", False)
    except ImproperlyConfigured as exc:
        raise ConfigError([str(exc)], "environment") from None


_cached: ServerConfig | None = None


def get_config() -> ServerConfig:
    """The process-wide configuration, loaded once (see :func:`load_config`)."""
    global _cached
    if _cached is None:
        _cached = load_config()
    return _cached


def install_config(config: ServerConfig) -> ServerConfig:
    """Make ``config`` the process-wide configuration that :func:`get_config` returns from now on, and
    return it. ``serve`` resolves its configuration once, from its command line and environment, and
    installs it, so nothing in its process parses the file a second time (its children read the same
    inputs from the environment it gives them)."""
    global _cached
    _cached = config
    return config
