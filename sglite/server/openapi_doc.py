"""A truthful ``/openapi.json``: every route's 200 body (JSON, and the streamed event for SSE
routes), and the error statuses the server really answers, each with its body model.

The routes return ready-made ``JSONResponse`` bodies, so their models are declared here, in one
table (:data:`ROUTE_MODELS`), and patched into FastAPI's generated schema; request validation
errors are 400s here (not FastAPI's 422), so 422 is replaced by the real statuses
(:func:`error_statuses`). Routes that declare their own models (``/v1/responses``, ``/tokenize``)
keep them and get the error statuses only.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from . import response_models as m

# (method, path) -> (JSON body model, streamed event model or None)
ROUTE_MODELS: dict[tuple[str, str], tuple[object, Optional[type[BaseModel]]]] = {
    ("post", "/generate"): ((m.GenerateOutput, list[m.GenerateOutput]), m.GenerateOutput),
    ("get", "/health"): (m.StatusResponse, None),
    ("get", "/health_generate"): (m.StatusResponse, None),
    ("get", "/get_model_info"): (m.ModelInfoResponse, None),
    ("get", "/get_server_info"): (m.ServerInfoResponse, None),
    ("post", "/flush_cache"): (m.FlushCacheResponse, None),
    ("post", "/abort_request"): (m.AbortResponse, None),
    ("post", "/load_lora_adapter"): (m.LoraAdapterResponse, None),
    ("post", "/unload_lora_adapter"): (m.LoraAdapterResponse, None),
    ("post", "/separate_reasoning"): (m.SeparateReasoningResponse, None),
    ("get", "/v1/models"): (m.ModelList, None),
    ("get", "/v1/models/{model_id}"): (m.ModelCard, None),
    ("post", "/v1/completions"): (m.Completion, m.Completion),
    ("post", "/v1/chat/completions"): (m.ChatCompletion, m.ChatCompletionChunk),
}
GENERATION = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}
ERROR_TEXT = {
    "400": "Bad input: the message and `param` name the field and the limit",
    "401": "Missing or wrong API key (when the server has one)",
    "404": "Unknown model, route or resource",
    "413": "Request body over --max-request-bytes",
    "429": "Too many requests (the router's per-client limit)",
    "500": "Internal error",
    "503": "Overloaded (`code` queue_full, with Retry-After) or the engine is unhealthy",
}


def error_statuses(method: str, path: str) -> list[str]:
    """The error statuses one route can answer."""
    codes = ["401", "404", "500"]
    if method in ("post", "put", "delete") or "{" in path:
        codes += ["400"]
    if method == "post":
        codes += ["413"]
    if path in GENERATION or path == "/health_generate":
        codes += ["503"]
    if path in GENERATION:
        codes += ["429"]
    return sorted(codes)


def _schema_ref(model, components: dict) -> dict:
    """The JSON schema of ``model`` (a pydantic class, ``list[...]`` or a tuple = anyOf), its
    definitions moved into ``components``."""
    if isinstance(model, tuple):
        return {"anyOf": [_schema_ref(x, components) for x in model]}
    if getattr(model, "__origin__", None) is list:
        return {"type": "array", "items": _schema_ref(model.__args__[0], components)}
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_openapi(app: FastAPI) -> dict:
    """FastAPI's schema of ``app`` with the bodies of :data:`ROUTE_MODELS` and the real error statuses."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    err = _schema_ref(m.ErrorResponse, comps)
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            known = ROUTE_MODELS.get((method, path))
            if known is not None:
                body, event = known
                content = {"application/json": {"schema": _schema_ref(body, comps)}}
                if event is not None:
                    content["text/event-stream"] = {
                        "schema": _schema_ref(event, comps),
                        "description": "with `stream: true`: Server-Sent Events, each `data:` line one such "
                                       "JSON object, ending with `data: [DONE]`"}
                responses["200"] = {"description": "OK", "content": content}
            elif path == "/metrics":
                responses["200"] = {"description": "Prometheus text exposition format",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            for code in error_statuses(method, path):
                entry = responses.setdefault(code, {"description": ERROR_TEXT[code]})
                entry.setdefault("content", {"application/json": {"schema": err}})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi` (built once, on first request) as ``app.openapi()``."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema
    app.openapi = openapi
