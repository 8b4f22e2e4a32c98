"""SGLang's native routes: ``/generate``, ``/health``, ``/get_model_info``, ``/get_server_info``,
``/flush_cache``, ``/abort_request``, ``/start_profile`` and ``/stop_profile`` (torch.profiler on the
engine thread: :mod:`sglite.runtime.profiler`), ``/metrics`` (with ``enable_metrics``).

Shapes follow SGLang's ``http_server.py`` and ``io_struct.GenerateReqInput`` (see
docs/reference/sglang_compat.md §c.1-c.3): a single request answers ``{"text", "output_ids",
"meta_info"}``, a batch (or ``n > 1``) a list of those; streaming sends cumulative outputs as SSE
(each with ``"index"`` in a batch) and ends with ``data: [DONE]``. One HTTP request is one engine
call: the engine fans out the batch and the ``n`` samples, with its request ids (``<rid>-<i>`` per
batch item, ``-<j>`` per sample; see :mod:`sglite.runtime.engine_protocol`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Optional
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..runtime.logprob_options import LogprobOptions
from .engine_client import EngineClient, GenCall, until_disconnect
from .errors import ApiError, error_response, from_value_error, jsonable
from .metrics import CONTENT_TYPE
from .protocol import (AbortRequest, GenerateRequest, LoadLoraAdapterRequest, ProfileRequest, SeparateReasoningRequest,
                       UnloadLoraAdapterRequest)
from .reasoning import get_reasoning_format, split_reasoning
from .sse import sse_event, sse_response


def _as_batch(req: GenerateRequest) -> tuple[list[dict], bool]:
    """``[{"prompt"|"input_ids": ...}]`` and whether the request is a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("exactly one of text or input_ids must be given", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [{"prompt": req.text}], False
        prompts, field = [{"prompt": t} for t in req.text], "text"
    else:
        ids = req.input_ids
        if ids and isinstance(ids[0], list):
            prompts, field = [{"input_ids": x} for x in ids], "input_ids"
        else:
            return [{"input_ids": ids}], False
    if not prompts:
        raise ApiError(f"{field}: a batch must not be empty", param=field)
    return prompts, True


def _sampling_list(req: GenerateRequest, size: int) -> list[dict]:
    sp = req.sampling_params
    if isinstance(sp, list):
        if len(sp) != size:
            raise ApiError(f"sampling_params: got {len(sp)} entries for a batch of {size}", param="sampling_params")
        return [dict(x) for x in sp]
    return [dict(sp or {}) for _ in range(size)]


def build_call(req: GenerateRequest, client: EngineClient) -> tuple[GenCall, bool]:
    """The engine call of a ``/generate`` request (prompts x ``n`` fanned out by the engine), and
    whether the answer is a list (a batch or ``n > 1``), validating each prompt's params.

    Raises:
        ApiError: 400 naming the field.
    """
    prompts, batch = _as_batch(req)
    sps = _sampling_list(req, len(prompts))
    if isinstance(req.rid, list) and len(req.rid) != len(prompts):
        raise ApiError(f"rid: got {len(req.rid)} ids for a batch of {len(prompts)}", param="rid")
    for p, sp in zip(prompts, sps):
        try:
            client.validate(sp)
        except ValueError as e:
            raise from_value_error(e, prefix="sampling_params.") from e
        if "input_ids" in p:
            try:
                client.check_ids(p["input_ids"], "input_ids")
            except ValueError as e:
                raise from_value_error(e) from e
    try:
        lp = LogprobOptions.from_args(req.return_logprob, req.logprob_start_len, req.top_logprobs_num)
    except ValueError as e:
        raise from_value_error(e) from e
    key = "input_ids" if "input_ids" in prompts[0] else "prompts"
    lora = req.lora_path
    if isinstance(lora, list) and (not batch or len(lora) != len(prompts)):
        raise ApiError(f"lora_path: got {len(lora)} names for {len(prompts)} prompt(s)", param="lora_path")
    call = GenCall(sampling_params=sps, rid=req.rid or uuid.uuid4().hex, logprobs=lp, batch=batch, lora_path=lora,
                   **{key: [p["input_ids" if key == "input_ids" else "prompt"] for p in prompts]})
    return call, batch or call.num_outputs > 1


def _grammar_rename(call: GenCall) -> dict:
    """``{"grammar": "sampling_params.<kind>"}`` of the first constrained prompt (for GrammarError)."""
    for sp in call.sampling_params:
        for key in ("regex", "json_schema", "ebnf", "lark", "structural_tag"):
            if sp.get(key) is not None:
                return {"grammar": f"sampling_params.{key}"}
    return {}


def _reasoning_splitter(name):
    """``out -> out`` moving the reasoning of ``out["text"]`` (cumulative) to ``out["reasoning_text"]``."""
    fmt = get_reasoning_format(name)

    def split(out: dict) -> dict:
        thought, out["text"] = split_reasoning(out.get("text") or "", fmt)
        out["reasoning_text"] = thought
        return out
    return split


def _adapters(client: EngineClient) -> dict:
    """``{name: path}`` of the LoRA adapters the engine serves."""
    lora = getattr(client.engine, "lora", None)
    return {} if lora is None else {n: a.path for n, a in sorted(lora.adapters.items())}


def _lora_op(client: EngineClient, name: str):
    """The engine's ``load_lora_adapter`` / ``unload_lora_adapter``; 400 naming ``lora_name`` for
    an engine without adapters (a tensor-parallel or stand-in engine)."""
    op = getattr(client.engine, name, None)
    if op is None:
        raise ApiError("lora_name: this engine serves no LoRA adapters", param="lora_name")
    return op


def build_native_router(client: EngineClient, metrics, server_info: dict, enable_metrics: bool = False,
                        reasoning_parser=None) -> APIRouter:
    """Routes bound to ``client`` (no module-level state); ``/metrics`` only with ``enable_metrics``
    (SGLang's ``--enable-metrics``; without it the route is absent: 404). ``reasoning_parser``:
    the ``--reasoning-parser`` name, for ``separate_reasoning`` and ``/separate_reasoning``."""
    router = APIRouter()

    @router.post("/separate_reasoning")
    async def separate_reasoning(req: SeparateReasoningRequest):
        name = req.reasoning_parser or reasoning_parser
        if name is None:
            raise ApiError("reasoning_parser: required (the server has no --reasoning-parser)",
                           param="reasoning_parser")
        try:
            fmt = get_reasoning_format(name)
        except ValueError as e:
            raise ApiError(str(e), param="reasoning_parser") from None
        thought, answer = split_reasoning(req.text, fmt)
        return JSONResponse({"text": answer, "reasoning_text": thought})

    @router.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        if req.separate_reasoning and reasoning_parser is None:
            raise ApiError("separate_reasoning: needs a server started with --reasoning-parser",
                           param="separate_reasoning")
        split = _reasoning_splitter(reasoning_parser) if req.separate_reasoning else (lambda out: out)
        # off the event loop, within the preparation budget: validating compiles every stop regex
        call, many = await client.prepare(build_call, req, client, field="sampling_params")
        # the engine names the prompt "prompt": this route's field is text or input_ids
        rename = {**_grammar_rename(call), "prompt": "input_ids" if req.input_ids is not None else "text"}
        if req.stream:
            try:
                stream = await client.open(call)  # cumulative events, as SGLang streams them
            except ValueError as e:
                raise from_value_error(e, rename, prefix="sampling_params.") from e

            async def events():
                async for i, chunk in stream:
                    out = split(jsonable(chunk))  # events are cumulative: split the text so far
                    if many:
                        out["index"] = i
                    yield sse_event(out)
            return sse_response(events())
        try:
            outs = await until_disconnect(request.receive, client.run(call))
        except ValueError as e:
            raise from_value_error(e, rename, prefix="sampling_params.") from e
        outs = [split(o) for o in jsonable(outs)]
        return JSONResponse(outs if many else outs[0])

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/health_generate")
    async def health_generate():
        try:
            await asyncio.wait_for(client.run(GenCall(prompts=["Hi"], sampling_params=[{
                "max_new_tokens": 1, "temperature": 0}])), timeout=20)
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"engine unhealthy: {type(e).__name__}: {e}", 503)
        return {"status": "ok"}

    @router.get("/get_model_info")
    async def get_model_info():
        info = jsonable(client.model_info)
        info.setdefault("tokenizer_path", info.get("model_path"))
        info.setdefault("is_generation", True)
        info["served_model_name"] = server_info.get("served_model_name")
        return info

    @router.get("/get_server_info")
    async def get_server_info():
        info = jsonable(await asyncio.to_thread(client.engine.get_server_info))
        info.update(server_info)
        info["version"] = __version__
        return info

    @router.post("/flush_cache")  # state-changing: POST only (a GET is reachable cross-site)
    async def flush_cache():
        ok = await asyncio.to_thread(client.engine.flush_cache)
        if not ok:
            return error_response("cache not flushed: requests are running or waiting", 400)
        return {"success": True, "message": "Cache flushed."}

    @router.post("/load_lora_adapter")  # operator routes (middleware.ADMIN_PATHS), SGLang's names
    async def load_lora_adapter(req: LoadLoraAdapterRequest):
        try:
            await asyncio.to_thread(_lora_op(client, "load_lora_adapter"), req.lora_name, req.lora_path)
        except ValueError as e:
            raise from_value_error(e) from e
        return {"success": True, "loaded_adapters": _adapters(client)}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest):
        try:
            await asyncio.to_thread(_lora_op(client, "unload_lora_adapter"), req.lora_name)
        except ValueError as e:
            raise from_value_error(e) from e
        return {"success": True, "loaded_adapters": _adapters(client)}

    @router.post("/start_profile")  # operator route (middleware.ADMIN_PATHS); POST only, as /flush_cache
    async def start_profile(req: Optional[ProfileRequest] = None):
        opts = (req or ProfileRequest()).model_dump()
        out = await asyncio.to_thread(lambda: client.engine.start_profile(**opts))
        return {"success": True, "message": "Start profiling.", "output_dir": out}

    @router.post("/stop_profile")
    async def stop_profile():
        result = await asyncio.to_thread(client.engine.stop_profile)
        return {"success": True, "message": "Stop profiling.", **result}

    @router.post("/abort_request")
    async def abort_request(req: AbortRequest, request: Request):
        if req.abort_all:
            if not request.app.state.keys.admits_admin(request.scope.get("headers")):
                raise ApiError("abort_all: requires the admin API key (Authorization: Bearer <admin key>, "
                               "set with --admin-api-key)", status=401, param="abort_all")
            return {"success": True, "aborted": client.abort_all()}
        if not req.rid:
            raise ApiError("give rid or abort_all", param="rid")
        return {"success": True, "aborted": client.abort_matching(req.rid)}

    if enable_metrics:
        @router.get("/metrics")
        async def metrics_route():
            return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return router


def public_server_info(cfg) -> dict:
    """Server options safe to show in ``/get_server_info`` (the API keys are hidden)."""
    d = dataclasses.asdict(cfg)
    for key in ("api_key", "admin_api_key"):
        d[key] = "***" if d.get(key) else None
    return d

