"""OpenAI-shaped error responses and the FastAPI exception handlers that produce them.

Every error body has OpenAI's nested form ``{"error": {"message", "type", "param", "code"}}``
and, for SGLang clients, the same keys flat at the top level plus ``"object": "error"``.
Bad input is 400 (FastAPI's own validation errors are also mapped to 400, as SGLang does),
a missing or wrong API key 401, an unknown route 404, a body over the cap 413, a full waiting queue
503 with ``Retry-After`` (``--max-queued-requests``); anything
unexpected is 500 with a generic message (the traceback goes to the log only).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling_params import SamplingParams
from ..errors import CONTEXT_LENGTH_PREFIX, GrammarError, QueueFullError, SgliteError


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable"}
_CONSTRAINTS = ("regex", "json_schema", "ebnf", "lark", "structural_tag")


class ApiError(Exception):
    """An error the server answers with ``status`` and an OpenAI-shaped body.

    Args:
        message: human-readable text; names the offending field.
        status: HTTP status code (400 for bad input).
        param: the request field at fault (OpenAI's ``param``), or None.
        code: OpenAI's ``code`` (a short string such as ``"model_not_found"``), or None.
    """

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int = 400, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """The JSON body of an error (both OpenAI's nested and SGLang's flat form)."""
    inner = {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
             "param": param, "code": code if code is not None else status}
    return {"object": "error", **inner, "error": dict(inner)}


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   code: Optional[str] = None) -> JSONResponse:
    """A JSONResponse carrying :func:`error_body`."""
    return JSONResponse(error_body(message, status, param, code), status_code=status)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def from_value_error(exc: ValueError, rename: Optional[dict] = None, prefix: str = "",
                     top_level: bool = False) -> ApiError:
    """Turn an engine/validation ``ValueError`` into a 400 :class:`ApiError`.

    ``InvalidRequestError.field`` becomes ``param``; ``rename`` maps engine field names to the
    API's names (e.g. ``max_new_tokens`` -> ``max_tokens``) in both the param and the message;
    its ``"grammar"`` entry names the request's constraint field for a ``GrammarError``.
    ``top_level`` (OpenAI routes): sampling fields are top-level request fields, so the message
    says ``n`` where the engine said ``sampling_params.n``.
    """
    field = getattr(exc, "field", None)
    msg = str(exc) or exc.__class__.__name__
    if field and rename and field in rename:
        api = rename[field]
        msg = re.sub(rf"\b{re.escape(field)}\b", api, msg.replace(f"sampling_params.{field}", api))
        field = api
    elif field:
        if top_level:  # an OpenAI route: its sampling fields are top-level (``n``, not ``sampling_params.n``)
            msg = msg.replace(f"sampling_params.{field}", field)
        field = f"{prefix}{field}" if field in _SAMPLING_FIELDS else field
    if field is None and isinstance(exc, GrammarError):
        head = msg.split(":", 1)[0].strip()
        field = head if head in _CONSTRAINTS else (rename or {}).get("grammar", "grammar")
        if rename and field in rename:
            field = rename[field]
        if field not in msg:
            msg = f"{field}: {msg}"
    code = "context_length_exceeded" if CONTEXT_LENGTH_PREFIX in msg else None
    return ApiError(msg, 400, param=field, code=code)


_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "json-or-python", "literal")


def _loc_to_param(loc: tuple) -> Optional[str]:
    """A request field's dotted path from pydantic's ``loc``, without the union-member tags pydantic
    inserts (``dict[str,any]``, ``function-after[...]``, ``str``) that name no field."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    parts = [p for p in parts if not ("[" in p or p.lower() in _UNION_TAGS)]
    return ".".join(parts) if parts else None


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", "body"
    param = _loc_to_param(tuple(first.get("loc", ())))
    msgs = []
    for e in errors[:3]:
        p = _loc_to_param(tuple(e.get("loc", ()))) or "body"
        msgs.append(f"{p}: {e.get('msg')}")
    return "; ".join(msgs), param


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so every error the app raises answers with :func:`error_body`."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype.lower() and any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors()):
            # curl -d without -H 'Content-Type: application/json' sends a form: FastAPI never parses it as JSON
            msg = (f"body: expected a JSON object with Content-Type: application/json, got content type "
                   f"{ctype or 'none'} ({msg})")
            param = param or "body"
        return error_response(msg, 400, param)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        resp = error_response(str(exc), 503, None, "queue_full")
        resp.headers["Retry-After"] = str(exc.retry_after)
        return resp

    @app.exception_handler(SgliteError)
    async def _sglite(_: Request, exc: SgliteError) -> JSONResponse:
        e = from_value_error(exc) if isinstance(exc, ValueError) else ApiError(str(exc), 400)
        return error_response(e.message, e.status, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)


def jsonable(obj: Any) -> Any:
    """Best-effort conversion of engine info (dataclasses, tuples, numbers) into JSON values."""
    import dataclasses
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if obj is None or isinstance(obj, (str, int, float, bool)):
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        return obj
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except Exception:  # noqa: BLE001 - best effort
            pass
    return str(obj)
