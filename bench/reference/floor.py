"""The floor of ``bench_latency``: the hops of a silero_vad request to audiosite, built bare (web part).

audiosite's request crosses three processes: the web process (daphne) parses the JSON body and
decodes the audio, hands the run to a worker process through Redis and waits for the worker's reply
on a pub/sub channel. This app does the same hops with nothing else: on our daphne
(``python -m audiosite.web``), for ``POST /v1/tasks/run`` with audiosite's body
(``{"model": ..., "request": {"audio_base64": ...}}``) it parses the JSON, base64-decodes the audio,
``LPUSH``es ``<id> <audio bytes>`` on the list ``FLOOR_QUEUE`` of the Redis at ``FLOOR_REDIS_URL``
(one round trip) and awaits the ``PUBLISH`` of the reply on its own channel; the worker
(:mod:`bench.reference.floor_worker`) ``BRPOP``s the list, decodes the WAV, runs our silero_vad
adapter's session and publishes the segments. No admission, lease, validation, logging or metrics:
what audiosite spends beyond this floor is what its own code costs (issue "close to the floor").

``GET /health`` answers ``{"status": "ok"}`` without touching Redis (the readiness probe of the bench).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid

import redis.asyncio as aioredis

FLOOR_QUEUE = "floor:runs"
"""The Redis list the web part pushes runs on and the worker pops."""

REPLY_CHANNEL_PREFIX = "floor:replies:"
"""Each web process subscribes to ``<prefix><its pid>``; a run's header names the channel for its reply."""

_OK = b'{"status":"ok"}'


class _Replies:
    """One pub/sub subscription per process; replies are handed to the waiting request by run id."""

    def __init__(self) -> None:
        self.client = aioredis.Redis.from_url(os.environ["FLOOR_REDIS_URL"])
        self.channel = f"{REPLY_CHANNEL_PREFIX}{os.getpid()}"
        self.waiting: dict[str, asyncio.Future[bytes]] = {}
        self.ready = asyncio.Event()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.channel)
        self.ready.set()
        async for message in pubsub.listen():
            if message["type"] != "message":
                continue
            run_id, _, reply = message["data"].partition(b" ")
            future = self.waiting.pop(run_id.decode(), None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def run(self, audio: bytes) -> bytes:
        """Push one run and await its reply (bytes of JSON)."""
        await self.ready.wait()
        run_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[run_id] = future
        await self.client.lpush(FLOOR_QUEUE, f"{run_id} {self.channel} ".encode() + audio)
        return await future


_replies: _Replies | None = None


async def _body(receive) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def application(scope, receive, send):
    """ASGI entry: ``POST /v1/tasks/run`` through the floor pipeline, anything else ``{"status":"ok"}``."""
    global _replies
    if scope["type"] != "http":
        return
    body = await _body(receive)
    payload = _OK
    if scope["method"] == "POST" and scope["path"] == "/v1/tasks/run":
        if _replies is None:
            _replies = _Replies()
        audio = base64.b64decode(json.loads(body)["request"]["audio_base64"])
        payload = await _replies.run(audio)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
