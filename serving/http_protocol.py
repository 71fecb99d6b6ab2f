"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol, with OpenAI's JSON error body for
requests that fail to parse (a malformed request line, header or `Content-Length`).

Those faults never reach the ASGI app, so FastAPI's handlers cannot shape them; uvicorn writes
a plain-text 400 itself. Clients of an OpenAI-compatible server parse every error as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.errors import error_body

PARSE_ERROR_MESSAGE = ("the HTTP request could not be parsed: malformed request line, "
                       "header or Content-Length")


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # uvicorn's hook for h11 parse errors
        import h11

        body = json.dumps(error_body(400, PARSE_ERROR_MESSAGE)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            # A fault in the client's own framing can leave h11 unable to answer in order
            # (for example mid-body); then the raw response is the only answer left.
            self.transport.write(_raw_response(headers, body))
        self.transport.close()


def _raw_response(headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [b"HTTP/1.1 400 Bad Request"] + [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def uvicorn_config(app: Any, host: str, port: int, **kwargs: Any) -> Any:
    """The one uvicorn configuration the CLI and the tests share."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=JsonErrorH11Protocol, **kwargs)
