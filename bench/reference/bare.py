"""A bare ASGI app: ``{"status": "ok"}`` for every HTTP request (reference 1 of ``bench_latency``)."""

BODY = b'{"status":"ok"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def application(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:  # drain the request body
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
