"""Engine outputs -> ``/v1/responses`` objects: output items, usage, the response, and the
streamed event sequence.

Output items: a ``reasoning`` item (``content: [{"type": "reasoning_text", "text"}]``) with the
model's thinking when a reasoning parser split it off, a ``message`` (one ``output_text`` part) for the text, then one ``function_call``
per tool call (``call_id`` is the call's id; the arguments text as generated). A call whose
arguments were cut by ``max_output_tokens`` (not valid JSON) has status ``incomplete``; the
response is ``incomplete`` with ``incomplete_details.reason == "max_output_tokens"`` whenever the
limit ended the output (``"aborted"`` when an abort did). An output with neither text nor calls is
one empty message.

Streamed, the events are (each with ``sequence_number`` counting from 0): ``response.created``,
``response.in_progress``; per message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``; the reasoning item
(first) ``response.output_item.added``, ``response.reasoning_text.delta``...,
``response.reasoning_text.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete``) carrying the whole response.
Source: OpenAI's Responses API streaming reference and the ``openai`` SDK's stream accumulator.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from .openai_format import now
from .request_pipeline import ParsedOutput
from .responses_input import new_item_id
from .responses_models import ResponsesRequest
from .sse import sse_event


@dataclass
class Turn:
    """One Responses request being served: its id, creation time, request, normalized input items
    and the stored conversation it continues (empty without ``previous_response_id``)."""

    id: str
    created_at: int
    req: ResponsesRequest
    input_items: list[dict]
    history: list[dict]


def _args_complete(arguments: str) -> bool:
    try:
        json.loads(arguments)
        return True
    except json.JSONDecodeError:
        return False


def message_item(text: str, status: str, item_id: Optional[str] = None, logprobs: Optional[list] = None) -> dict:
    """An assistant ``message`` output item with one ``output_text`` part (``logprobs``: its token
    entries, when asked for)."""
    return {"type": "message", "id": item_id or new_item_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def text_logprobs(entries: list[dict], content: Optional[str], calls: bool) -> list[dict]:
    """The logprob entries (chat's ``{"token", "logprob", "bytes", "top_logprobs"}``) of the message
    text: all of them without tool calls, else those of the tokens before the calls' text."""
    if not calls:
        return entries
    out, n = [], len(content or "")
    for e in entries:
        if n <= 0:
            break
        out.append(e)
        n -= len(e["token"])
    return out


def reasoning_item(text: str, status: str, item_id: Optional[str] = None) -> dict:
    """A ``reasoning`` output item holding the separated thinking as one ``reasoning_text`` part."""
    return {"type": "reasoning", "id": item_id or new_item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, item_id: Optional[str] = None,
              status: Optional[str] = None) -> dict:
    """A ``function_call`` output item; ``status`` defaults to ``completed`` when ``arguments`` is
    complete JSON, else ``incomplete``."""
    return {"type": "function_call", "id": item_id or new_item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status or ("completed" if _args_complete(arguments) else "incomplete")}


def output_items(parsed: ParsedOutput, incomplete: bool, logprobs: Optional[list] = None) -> list[dict]:
    """The output items of one parsed output (see the module docstring); ``logprobs``: the
    output's logprob entries (the message text's are put on its ``output_text`` part)."""
    items = [reasoning_item(parsed.reasoning, "completed")] if parsed.reasoning else []
    if parsed.content or not parsed.tool_calls:
        lps = text_logprobs(logprobs, parsed.content, bool(parsed.tool_calls)) if logprobs else None
        items.append(message_item(parsed.content or "", "incomplete" if incomplete else "completed", logprobs=lps))
    for c in parsed.tool_calls:
        items.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def usage(meta: Optional[dict]) -> Optional[dict]:
    """Responses ``usage`` of the engine's ``meta_info`` (``cached_tokens``: radix-cache hits)."""
    if meta is None:
        return None
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def response_object(turn: Turn, model: str, items: list[dict], status: str, use: Optional[dict],
                    reason: Optional[str] = None) -> dict:
    """The response (``object: "response"``) of ``turn`` in its current state; ``reason``: the
    ``incomplete_details.reason`` of an ``incomplete`` one (default ``max_output_tokens``)."""
    req = turn.req
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {"id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
            "completed_at": now() if status in ("completed", "incomplete") else None, "error": None,
            "incomplete_details": {"reason": reason or "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": items, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt or {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": list(req.tools or []), "store": req.store, "metadata": dict(req.metadata or {}),
            "usage": use, "user": req.user, "background": bool(req.background),
            "truncation": req.truncation or "disabled"}


class EventWriter:
    """The streamed events of one response, in order, with their sequence numbers; ``items`` are
    the output items so far (the open one last)."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []
        self.open: Optional[str] = None  # "reasoning" | "message" | "function_call" | None

    def event(self, kind: str, **fields) -> bytes:
        ev = sse_event({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return ev

    def start(self, response: dict) -> list[bytes]:
        return [self.event("response.created", response=response), self.event("response.in_progress", response=response)]

    def _where(self) -> dict:
        return {"output_index": len(self.items) - 1, "item_id": self.items[-1]["id"]}

    def reasoning(self, delta: str) -> list[bytes]:
        """Events of new reasoning text (opening the reasoning item on its first text)."""
        if not delta:
            return []
        out = []
        if self.open != "reasoning":
            out += self.close("completed")
            self.items.append(reasoning_item("", "in_progress"))
            self.open = "reasoning"
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.items[-1], content=[])))
        self.items[-1]["content"][0]["text"] += delta
        out.append(self.event("response.reasoning_text.delta", content_index=0, delta=delta, **self._where()))
        return out

    def text(self, delta: str, logprobs: Optional[list] = None) -> list[bytes]:
        """Events of new message text (opening the message on its first text); ``logprobs``: the
        entries of the tokens that produced it (with logprobs on)."""
        if not delta:
            return []
        out = []
        if self.open != "message":
            out += self.close("completed")
            self.items.append(message_item("", "in_progress"))
            self.items[-1]["content"] = []
            self.open = "message"
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.items[-1], content=[])))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items[-1]["content"].append(part)
            out.append(self.event("response.content_part.added", content_index=0, part=dict(part), **self._where()))
        self.items[-1]["content"][0]["text"] += delta
        self.items[-1]["content"][0]["logprobs"] += logprobs or []
        out.append(self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=logprobs or [],
                              **self._where()))
        return out

    def call(self, entry: dict) -> list[bytes]:
        """Events of one tool-call delta: a call's first entry (id, name, maybe arguments) opens it."""
        out = []
        fn = entry.get("function") or {}
        if "id" in entry:
            out += self.close("completed")
            self.items.append(call_item(entry["id"], fn["name"], "", status="in_progress"))
            self.open = "function_call"
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.items[-1])))
        delta = fn.get("arguments") or ""
        if delta and self.open == "function_call":
            self.items[-1]["arguments"] += delta
            out.append(self.event("response.function_call_arguments.delta", delta=delta, **self._where()))
        return out

    def close(self, status: str) -> list[bytes]:
        """Events closing the open item (``status``: the message's when it ends the output)."""
        if self.open is None:
            return []
        item, where, out = self.items[-1], self._where(), []
        if self.open == "reasoning":
            out.append(self.event("response.reasoning_text.done", content_index=0, text=item["content"][0]["text"],
                                  **where))
            item["status"] = "completed"
        elif self.open == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", content_index=0, text=part["text"],
                                  logprobs=part["logprobs"], **where))
            out.append(self.event("response.content_part.done", content_index=0, part=dict(part), **where))
            item["status"] = status
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=item["arguments"], **where))
            item["status"] = "completed" if _args_complete(item["arguments"]) else "incomplete"
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self.open = None
        return out

    def end(self, status: str) -> list[bytes]:
        """Close the last item (an empty message when nothing but reasoning was output)."""
        if not any(it["type"] != "reasoning" for it in self.items):
            out = self.close(status)
            self.open = "message"
            self.items.append(message_item("", "in_progress"))
            item = self.items[-1]
            out += [self.event("response.output_item.added", output_index=len(self.items) - 1,
                               item=dict(item, content=[])),
                    self.event("response.content_part.added", content_index=0, part=dict(item["content"][0]),
                               **self._where())]
            return out + self.close(status)
        return self.close(status)

    def finish(self, response: dict) -> bytes:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=response)
