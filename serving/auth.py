"""Bearer-key check for the ``/v1`` routes, as a pure ASGI middleware.

It runs before the body is read or validated, so a request without the right key learns
nothing else about the server (not even whether its JSON was valid). The comparison is
constant-time (``hmac.compare_digest``) so response timing does not leak key prefixes.
``/health`` and ``/metrics`` stay open, as in vLLM, for probes and scrapers.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.errors import error_response

PROTECTED_PREFIX = "/v1"


def key_matches(header: str | None, api_key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            header = None
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            if not key_matches(header, self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not header
                           else "invalid API key")
                response = error_response(401, message,
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
