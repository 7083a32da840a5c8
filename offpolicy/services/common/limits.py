"""Request bodies over `max_body_bytes` answer 413 in the error envelope, before any route parses them.

A pure ASGI middleware: a declared `Content-Length` over the limit is refused at once; a body without one
(chunked) is counted as it is read and refused once it passes the limit (the route's body parsing sees an
`HTTPException(413)`, which the envelope handler answers). Nothing past the limit is buffered.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_message(limit: int) -> str:
    return f"request body larger than {limit} bytes (OFFPOLICY_MAX_BODY_BYTES)"


class BodySizeLimit:
    """Wraps an ASGI app: HTTP request bodies larger than `max_bytes` get 413 `payload_too_large`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {
            "error": {
                "code": "payload_too_large",
                "message": too_large_message(self.max_bytes),
                "detail": None,
            }
        }
        response = JSONResponse(body, status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
