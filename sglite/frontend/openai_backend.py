"""``OpenAI``: run ``@function`` programs against any OpenAI-compatible server (SGLang's ``sgl.OpenAI``).

    backend = sglite.OpenAI("SmolLM2-135M-Instruct", base_url="http://127.0.0.1:30000/v1", api_key="EMPTY")
    state = program.run(backend=backend)

Routes: ``POST {base_url}/chat/completions`` and ``POST {base_url}/completions`` (plain httpx, no
``openai`` package needed). Which one a ``gen`` uses:

* chat, when the gen opens an assistant turn (``assistant(gen(...))``: the turn has no text
  yet): the program's messages are sent; ``is_chat_model=True`` forces chat and raises for a gen
  anywhere else (the chat API cannot continue a partial turn), as SGLang's backend does;
* completions otherwise (text outside roles, or an assistant turn that already has text), with
  the program text as the prompt; ``is_chat_model=False`` forces it.

The program text is rendered with ``chat_template`` when given; else the server's own role
markers when it serves SGLang's ``GET /get_model_info`` (sglite, SGLang), else plain
``"User: …\\n"`` lines.

Constraints: ``json_schema`` goes as ``response_format: {"type": "json_schema", …}`` (the OpenAI
standard). ``regex`` and SGLang's extra sampling fields (``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``stop_regex``) go in the request body as SGLang/sglite read
them (``extra_body="sglang"``, default), as vLLM's ``guided_regex`` (``extra_body="vllm"``), or are
dropped with a warning (``extra_body=None``; for api.openai.com), as SGLang's backend does.

``select``: scored by the prompt tokens' logprobs of ``prompt + choice`` from ``/completions``
with ``echo`` and ``logprobs`` (what lm-eval does), decided by the choices method; when the server
returns no prompt logprobs (or in chat), by a constrained choice: one generation limited to the
choices (regex alternation, or vLLM's ``guided_choice``), mapped to the choice it matches (or
shares the longest prefix with, when the server ignored the constraint); its meta_info then has
``"method": "constrained"`` and no scores.

Errors: an HTTP 4xx raises InvalidRequestError carrying the server's message; other failures
SgliteError naming the route and status.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx

from sglite.errors import InvalidRequestError, SgliteError

from .backend import Backend
from .chat_template import ChatContext, ChatTemplate
from .choices import ChoicesDecision, ChoicesMethod
from .runtime_endpoint import sse_objects

logger = logging.getLogger(__name__)

#: the program text's markers when the server does not tell its own
PLAIN_TEMPLATE = ChatTemplate({"system": ("System: ", "\n"), "user": ("User: ", "\n"),
                               "assistant": ("Assistant: ", "\n")})
#: SGLang sampling fields that are not OpenAI's; sent only with an ``extra_body`` style
_EXTRA = {"top_k": -1, "min_p": 0.0, "min_new_tokens": 0, "ignore_eos": False, "stop_token_ids": None,
          "stop_regex": None}
_STYLES = ("sglang", "vllm", None)


@dataclass
class TokenUsage:
    """Tokens counted from the responses' ``usage`` (SGLang's ``backend.token_usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0


class OpenAI(Backend):
    """A frontend backend for an OpenAI-compatible server (see the module docstring).

    Args:
        model_name: the ``model`` of every request.
        base_url: the API root, e.g. ``http://127.0.0.1:30000/v1`` (default ``$OPENAI_BASE_URL``
            or ``https://api.openai.com/v1``).
        api_key: sent as a bearer token (default ``$OPENAI_API_KEY``, else none).
        is_chat_model: None (chat for a gen that opens an assistant turn), True or False.
        chat_template: a :class:`ChatTemplate` for the program text.
        extra_body: ``"sglang"`` (default), ``"vllm"`` or None (see the module docstring).
        timeout: seconds per request.

    Raises:
        ValueError: an unknown ``extra_body`` style.
    """

    wants_messages = True
    #: ``@function(num_api_spec_tokens=N)`` applies (each request costs; see :mod:`.executor`)
    supports_api_speculation = True

    def __init__(self, model_name: str, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 is_chat_model: Optional[bool] = None, chat_template: Optional[ChatTemplate] = None,
                 extra_body: Optional[str] = "sglang", timeout: Optional[float] = 600.0):
        if extra_body not in _STYLES:
            raise ValueError(f"OpenAI.extra_body: must be one of {_STYLES}, got {extra_body!r}")
        self.model_name, self.is_chat_model, self.extra_body = model_name, is_chat_model, extra_body
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout)
        self._template = chat_template
        self._lock = threading.Lock()
        self._echo_logprobs: Optional[bool] = None  # learnt on the first select
        self.token_usage = TokenUsage()

    # ------------------------------------------------------------------ plumbing
    def _post(self, route: str, payload: dict) -> dict:
        res = self._client.post(self.base_url + route, json=payload)
        self._check(route, res)
        out = res.json()
        self._count(out.get("usage"))
        return out

    @staticmethod
    def _check(route: str, res: httpx.Response) -> None:
        if res.status_code == 200:
            return
        try:
            body = res.json()
            err = body.get("error")
            msg = (err.get("message") if isinstance(err, dict) else err) or body.get("message") or json.dumps(body)
        except (ValueError, AttributeError):
            msg = res.text
        if 400 <= res.status_code < 500:
            raise InvalidRequestError(f"{route}: HTTP {res.status_code}: {msg}")
        raise SgliteError(f"{route} failed with HTTP {res.status_code}: {msg}")

    def _count(self, usage: Optional[dict]) -> None:
        if usage:
            with self._lock:
                self.token_usage.prompt_tokens += usage.get("prompt_tokens") or 0
                self.token_usage.completion_tokens += usage.get("completion_tokens") or 0

    # ------------------------------------------------------------------ Backend
    def get_chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = self._server_template()
            return self._template

    def _server_template(self) -> ChatTemplate:
        root = re.sub(r"/v1$", "", self.base_url)
        try:
            res = self._client.get(root + "/get_model_info", timeout=10)
            if res.status_code == 200 and res.json().get("role_markers"):
                return ChatTemplate.from_model_info(res.json())
        except (httpx.HTTPError, ValueError):
            pass
        return PLAIN_TEMPLATE

    def _use_chat(self, chat: Optional[ChatContext], what: str) -> bool:
        at_turn_start = chat is not None and chat.role == "assistant" and not chat.partial
        if self.is_chat_model is False:
            return False
        if self.is_chat_model and not at_turn_start:
            raise InvalidRequestError(f"OpenAI chat model {self.model_name!r}: a {what} must open an assistant "
                                      f"turn (assistant({what}(...))): the chat API cannot continue text",
                                      field="is_chat_model")
        return at_turn_start

    def _body(self, sp: dict, logprob: dict, chat_api: bool) -> dict:
        """The OpenAI request fields of SGLang sampling params ``sp``."""
        # a LoRA adapter is a model of the OpenAI API (sglite's and SGLang's servers)
        body = {"model": logprob.get("lora_path") or self.model_name, "max_tokens": sp.get("max_new_tokens", 128)}
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("frequency_penalty", "frequency_penalty"),
                         ("presence_penalty", "presence_penalty"), ("n", "n"), ("stop", "stop"), ("seed", "seed")):
            if sp.get(src) is not None:
                body[dst] = sp[src]
        if sp.get("json_schema") is not None:
            schema = sp["json_schema"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        extras = {k: sp[k] for k, dflt in _EXTRA.items() if sp.get(k) not in (None, dflt)}
        if sp.get("regex") is not None:
            extras["regex"] = sp["regex"]
        if sp.get("ebnf") is not None:
            extras["ebnf"] = sp["ebnf"]
        if extras:
            if self.extra_body == "sglang":
                if "min_new_tokens" in extras:
                    extras["min_tokens"] = extras.pop("min_new_tokens")
                body.update(extras)
            elif self.extra_body == "vllm":
                renamed = {"regex": "guided_regex", "ebnf": "guided_grammar", "min_new_tokens": "min_tokens"}
                body.update({renamed.get(k, k): v for k, v in extras.items() if k != "stop_regex"})
            else:
                logger.warning("OpenAI backend: %s not supported by this server (extra_body=None); ignored",
                               sorted(extras))
        if logprob.get("return_logprob"):
            k = int(logprob.get("top_logprobs_num") or 0)
            if chat_api:
                body["logprobs"] = True
                if k:
                    body["top_logprobs"] = k
            else:
                body["logprobs"] = k
        return body

    @staticmethod
    def _finish(choice: dict) -> dict:
        reason = choice.get("finish_reason")
        if reason == "length":
            return {"type": "length"}
        return {"type": reason or "stop", "matched": choice.get("matched_stop")}

    def _result(self, choice: dict, text: str, usage: dict, chat_api: bool) -> dict:
        meta = {"finish_reason": self._finish(choice), "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "completion_tokens": (usage or {}).get("completion_tokens")}
        lp = choice.get("logprobs")
        if lp:
            if chat_api:
                meta["output_token_logprobs"] = [[e.get("logprob"), None, e.get("token")] for e in lp.get("content") or []]
            else:
                meta["output_token_logprobs"] = [[v, None, t] for v, t in zip(lp.get("token_logprobs") or [],
                                                                              lp.get("tokens") or [])]
        return {"text": text, "output_ids": [], "meta_info": meta}

    def _request(self, prompt: str, sp: dict, logprob: dict, chat: Optional[ChatContext]):
        """``(route, payload, chat_api)`` of one generation."""
        chat_api = self._use_chat(chat, "gen")
        body = self._body(sp, logprob, chat_api)
        if chat_api:
            return "/chat/completions", {**body, "messages": list(chat.messages)}, True
        return "/completions", {**body, "prompt": prompt}, False

    def generate(self, prompt, sampling_params, chat: Optional[ChatContext] = None, **logprob):
        route, payload, chat_api = self._request(prompt, dict(sampling_params), logprob, chat)
        out = self._post(route, payload)
        results = []
        for c in sorted(out.get("choices") or [], key=lambda c: c.get("index", 0)):
            text = (c.get("message") or {}).get("content") or "" if chat_api else c.get("text") or ""
            results.append(self._result(c, text, out.get("usage"), chat_api))
        if not results:
            raise SgliteError(f"{route}: the server returned no choices")
        return results if len(results) > 1 else results[0]

    def generate_stream(self, prompt, sampling_params, chat: Optional[ChatContext] = None, **logprob) -> Iterator[dict]:
        sp = dict(sampling_params)
        route, payload, chat_api = self._request(prompt, sp, logprob, chat)
        payload.update(stream=True, stream_options={"include_usage": True})
        text, last, usage = "", {}, None
        with self._client.stream("POST", self.base_url + route, json=payload) as res:
            if res.status_code != 200:
                res.read()
                self._check(route, res)
            for obj in sse_objects(res, route):
                usage = obj.get("usage") or usage
                for c in obj.get("choices") or []:
                    delta = ((c.get("delta") or {}).get("content") if chat_api else c.get("text")) or ""
                    text += delta
                    last = c if c.get("finish_reason") else last
                    if delta:
                        yield {"text": text, "output_ids": [], "meta_info": {"finish_reason": None}}
        self._count(usage)
        yield self._result(last, text, usage, chat_api)

    # ------------------------------------------------------------------ select
    def score(self, prompt, continuations, unconditional=False, lora_path=None):
        """Logprobs of each continuation's tokens after ``prompt``, from ``/completions`` with
        ``echo`` + ``logprobs`` (one batched request).

        ``lora_path`` (a LoRA adapter's name) is sent as the ``model``.

        Raises:
            InvalidRequestError: the server gave no prompt logprobs for a continuation.
        """
        model = lora_path or self.model_name
        out = self._echo_scores([prompt + c for c in continuations], [len(prompt)] * len(continuations), model)
        if unconditional:
            unc = self._echo_scores(list(continuations), [0] * len(continuations), model)
            for r, u in zip(out, unc):
                r["unconditional_logprobs"] = u["logprobs"]
        return out

    def _echo_scores(self, texts: list, starts: list, model: str) -> list:
        out = self._post("/completions", {"model": model, "prompt": texts, "max_tokens": 1, "echo": True,
                                          "logprobs": 0, "temperature": 0})
        res = []
        for c, text, start in zip(sorted(out["choices"], key=lambda c: c.get("index", 0)), texts, starts):
            lp = c.get("logprobs") or {}
            toks, lps, offs = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("text_offset") or []
            entries = []
            for i, (t, v, o) in enumerate(zip(toks, lps, offs)):
                end = offs[i + 1] if i + 1 < len(offs) else o + len(t)
                if o < len(text) and end > start:  # a token of the continuation (not the generated one)
                    entries.append((v, t))
            if not entries or (start > 0 and any(v is None for v, _ in entries)):
                raise InvalidRequestError("/completions: the server returned no prompt logprobs with echo")
            res.append({"token_ids": [None] * len(entries), "logprobs": [v for v, _ in entries],
                        "texts": [t for _, t in entries]})
        return res

    def select(self, prompt, choices, choices_method: ChoicesMethod, chat: Optional[ChatContext] = None,
               lora_path: Optional[str] = None) -> ChoicesDecision:
        chat_api = self._use_chat(chat, "select")
        if not chat_api and self._echo_logprobs is not False:
            try:
                decision = super().select(prompt, choices, choices_method, lora_path)
                self._echo_logprobs = True
                return decision
            except InvalidRequestError as e:
                if self._echo_logprobs:
                    raise
                logger.info("OpenAI backend: no echo logprobs (%s); select falls back to a constrained choice", e)
                self._echo_logprobs = False
        return self._constrained_select(prompt, list(choices), chat if chat_api else None, lora_path)

    def _constrained_select(self, prompt: str, choices: list, chat: Optional[ChatContext],
                            lora_path: Optional[str] = None) -> ChoicesDecision:
        sp = {"max_new_tokens": max(16, max(len(c) for c in choices)), "temperature": 0}
        if self.extra_body == "vllm":
            out = self._post_choice(prompt, sp, chat, {"guided_choice": choices}, lora_path)
        else:
            sp["regex"] = "(" + "|".join(re.escape(c) for c in choices) + ")"
            out = self.generate(prompt, sp, chat=chat, **({"lora_path": lora_path} if lora_path else {}))
        text = out["text"]
        decision = text if text in choices else max(
            choices, key=lambda c: (len(_common_prefix(c, text.strip())), -choices.index(c)))
        return ChoicesDecision(decision, {"method": "constrained", "generated": text,
                                          "normalized_prompt_logprobs": None})

    def _post_choice(self, prompt, sp, chat, extra: dict, lora_path: Optional[str] = None) -> dict:
        route, payload, chat_api = self._request(prompt, sp, {"lora_path": lora_path} if lora_path else {}, chat)
        out = self._post(route, {**payload, **extra})
        c = out["choices"][0]
        return {"text": ((c.get("message") or {}).get("content") if chat_api else c.get("text")) or ""}

    def cache_prefix(self, prefix: str) -> dict:
        """Not part of the OpenAI API (no prefill-only request): a no-op, as in SGLang's backend;
        the server's own prefix cache still sees the shared prefix on the first request."""
        return {}

    def flush_cache(self) -> bool:
        """Not part of the OpenAI API: a no-op that returns False."""
        return False

    def get_server_info(self) -> dict:
        """``GET {base_url}/models`` (the OpenAI API has no server-info route)."""
        res = self._client.get(self.base_url + "/models")
        self._check("/models", res)
        return {"base_url": self.base_url, "model": self.model_name, "models": res.json().get("data")}

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __repr__(self):
        return f"OpenAI({self.model_name!r}, base_url={self.base_url!r})"


def _common_prefix(a: str, b: str) -> str:
    return os.path.commonprefix([a, b])
