"""RuntimeEndpoint: a backend that talks to an sglite server over its native HTTP API.

Routes (SGLang's shapes): ``POST /generate`` (``{"text": str | list, "sampling_params": {...},
"return_logprob", "logprob_start_len", "top_logprobs_num", "input_ids", "stream"}``; streaming is
SSE ``data: {...}`` events with cumulative text, ending with ``data: [DONE]``), ``POST
/flush_cache``, ``GET /get_model_info``, ``GET /get_server_info``.

``select`` scoring follows SGLang's RuntimeEndpoint.select (runtime_endpoint.py): prefill the
prompt with ``max_new_tokens=0`` (caches it, gives ``prompt_tokens`` = P), then one batched
prefill-only request for ``prompt + choice`` with logprobs from position P−1, then drop the
first entry when it is the prompt's own last token (no merge across the boundary).
"""
from __future__ import annotations

import json
import threading
from typing import Optional

import httpx

from sglite.errors import InvalidRequestError, SgliteError

from .backend import Backend, logprob_kwargs, start_token_id
from .chat_template import ChatTemplate


class RuntimeEndpoint(Backend):
    """HTTP backend for ``sglite serve`` (or any server with SGLang's native routes).

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        timeout: seconds per request (None = no limit).

    Errors: an HTTP 4xx raises InvalidRequestError with the server's message; other failures
    raise SgliteError naming the route and status.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: Optional[float] = 600.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._model_info: Optional[dict] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def _check(self, route: str, res: httpx.Response) -> None:
        if res.status_code == 200:
            return
        try:
            body = res.json()
            msg = body.get("message") or body.get("error", {}).get("message") or json.dumps(body)
        except (ValueError, AttributeError):
            msg = res.text
        if 400 <= res.status_code < 500:
            raise InvalidRequestError(f"{route}: {msg}")
        raise SgliteError(f"{route} failed with HTTP {res.status_code}: {msg}")

    def _post(self, route: str, payload: dict):
        res = self._client.post(route, json=payload)
        self._check(route, res)
        return res.json()

    def _get(self, route: str):
        res = self._client.get(route)
        self._check(route, res)
        return res.json()

    # ------------------------------------------------------------------ Backend
    def get_model_info(self) -> dict:
        """``GET /get_model_info`` (cached after the first call)."""
        with self._lock:
            if self._model_info is None:
                self._model_info = self._get("/get_model_info")
            return self._model_info

    def get_chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_model_info(self.get_model_info())

    def _input(self, prompt: str) -> dict:
        if prompt == "":  # nothing to tokenize: start from the model's BOS (see Backend)
            return {"input_ids": [start_token_id(self.get_model_info())]}
        return {"text": prompt}

    def generate(self, prompt, sampling_params, **logprob):
        return self._post("/generate", {**self._input(prompt), "sampling_params": dict(sampling_params),
                                        **logprob_kwargs(**logprob, with_text_flag=True)})

    def generate_stream(self, prompt, sampling_params, **logprob):
        payload = {**self._input(prompt), "sampling_params": dict(sampling_params), "stream": True,
                   **logprob_kwargs(**logprob, with_text_flag=True)}
        with self._client.stream("POST", "/generate", json=payload) as res:
            if res.status_code != 200:
                res.read()
                self._check("/generate", res)
            yield from sse_objects(res, "/generate")

    def score(self, prompt, continuations, unconditional=False, lora_path=None):
        lora = {"lora_path": lora_path} if lora_path else {}  # the adapter scores, and owns the cached prefix
        prompt_tokens = self.generate(prompt, {"max_new_tokens": 0}, **lora)["meta_info"]["prompt_tokens"]
        start = max(prompt_tokens - 1, 0)
        objs = self._post("/generate", {"text": [prompt + c for c in continuations],
                                        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                        "return_logprob": True, "logprob_start_len": start, **lora})
        out = []
        for obj in objs:
            entries = [e for e in obj["meta_info"]["input_token_logprobs"] if e[0] is not None]
            first_text = entries[0][2] if entries and len(entries[0]) > 2 else None
            if len(entries) > 1 and prompt_tokens > 0 and (
                    (first_text is not None and prompt.endswith(first_text))
                    or (first_text is None and obj["meta_info"]["prompt_tokens"] - prompt_tokens < len(entries))):
                entries = entries[1:]
            out.append({"token_ids": [e[1] for e in entries], "logprobs": [e[0] for e in entries],
                        "texts": [e[2] if len(e) > 2 else None for e in entries]})
        if unconditional:
            objs = self._post("/generate", {"input_ids": [r["token_ids"] for r in out],
                                            "sampling_params": {"max_new_tokens": 0},
                                            "return_logprob": True, "logprob_start_len": 0, **lora})
            for r, obj in zip(out, objs):
                r["unconditional_logprobs"] = [e[0] for e in obj["meta_info"]["input_token_logprobs"]]
        return out

    def flush_cache(self) -> bool:
        res = self._client.post("/flush_cache")
        return res.status_code == 200

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __repr__(self):
        return f"RuntimeEndpoint({self.base_url!r})"


def sse_objects(res, route: str):
    """The JSON objects of a server-sent-event response (``data: {...}`` lines up to ``[DONE]``).

    Raises:
        InvalidRequestError: an event carries an ``error`` (its message, prefixed with ``route``)."""
    for line in res.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            raise InvalidRequestError(f"{route}: {err.get('message', err) if isinstance(err, dict) else err}")
        yield obj
