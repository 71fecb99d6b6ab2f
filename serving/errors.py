"""Every error leaves the server as OpenAI's shape: ``{"error": {message, type, param, code}}``.

Handlers cover our own ``APIError``, FastAPI's validation errors (malformed JSON or
fields -> 400, as OpenAI and vLLM answer), Starlette HTTP errors (404 route, 405, 413)
and, as the last resort, any exception (500 with a generic message; the traceback goes to
the log, not to the client).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

# One wording for a request the engine failed, whether it streams (error event) or not (500).
ENGINE_FAILED = ("the engine failed while generating this request; it was aborted "
                 "(the server keeps serving)")


class APIError(Exception):
    """An error answered to the client with ``status`` and ``message``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _describe(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence out of pydantic's error list, plus the first field's name."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = e.get("msg", "invalid value")
        cause = e.get("ctx", {}).get("error")
        if isinstance(cause, ValueError) and isinstance(getattr(cause, "param", None), str):
            # A RequestFieldError from a cross-field check names its own field.
            if param is None:
                param = cause.param
            parts.append(str(cause))
            continue
        msg = msg.removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{where}': this server does not implement it")
        elif e.get("type") == "json_invalid":
            detail = e.get("ctx", {}).get("error", msg)
            parts.append(f"the request body is not valid JSON ({detail})")
        elif e.get("type") == "missing" and not where:
            parts.append("the request body is required (a JSON object)")
        elif e.get("type") == "missing":
            parts.append(f"field '{where}' is required")
        else:
            parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        return error_response(500, "internal server error")
