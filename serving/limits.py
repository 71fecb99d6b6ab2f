"""Request body size limit (413) enforced before the body is parsed.

A declared ``Content-Length`` over the limit is refused without reading anything; a
chunked body is counted as it arrives and refused as soon as it crosses the limit (the
``HTTPException`` raised from ``receive`` surfaces through FastAPI's body parsing, which
re-raises HTTP exceptions unchanged, and becomes a JSON 413).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.errors import error_response


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    await error_response(400, "invalid Content-Length header")(
                        scope, receive, send)
                    return
                if declared > self.max_bytes:
                    await error_response(413, self._too_large())(scope, receive, send)
                    return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counting_receive, send)
