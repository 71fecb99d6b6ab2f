"""The HTTP/1.1 connection protocol: uvicorn's httptools protocol (llhttp's C parser, and
chunked writes without a per-chunk state machine in Python), with OpenAI's JSON error body for
requests that fail to parse (a malformed request line, header or `Content-Length`).

Why httptools, not h11: every streamed token is one SSE chunk per request per step, written
while the engine thread wants the cores; uvicorn's httptools protocol frames a chunk with a
few byte joins where h11 runs a pure-Python state machine per event.

Parse faults never reach the ASGI app, so FastAPI's handlers cannot shape them; uvicorn writes
a plain-text 400 itself. Clients of an OpenAI-compatible server parse every error as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving.errors import error_body

PARSE_ERROR_MESSAGE = ("the HTTP request could not be parsed: malformed request line, "
                       "header or Content-Length")


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:  # uvicorn's hook for parse errors
        body = json.dumps(error_body(400, PARSE_ERROR_MESSAGE)).encode()
        head = [b"HTTP/1.1 400 Bad Request"]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json",
                 b"content-length: " + str(len(body)).encode(), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, **kwargs: Any) -> Any:
    """The one uvicorn configuration the CLI and the tests share."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=JsonErrorHttpToolsProtocol,
                          **kwargs)
