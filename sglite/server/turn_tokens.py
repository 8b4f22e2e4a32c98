"""Token-exact multi-turn prompts: past assistant turns are re-sent as the tokens the model generated.

An agent resends its history every turn (or the server replays it for ``previous_response_id``).
For the radix cache to hit turn N's output, turn N+1's prompt must contain *the same token ids*
the model generated, not a re-rendering of them. Two things break that when the history is
rendered by the chat template and tokenized again:

* the template writes the assistant's tool calls in its own way (``tojson`` spacing, key order,
  or not at all), not as the model wrote them;
* even the same text tokenizes differently: a model (above all under a grammar) may split
  ``' {"'`` as ``' {'``, ``'"'``, where the tokenizer's canonical split is one token.

:class:`TurnTokens` remembers, for each generated assistant turn, its raw text and its output
token ids, keyed by a hash of the message the client will send back (content + calls; the call
arguments compared as parsed JSON, so a client that re-serializes them still matches; call ids
ignored). When a later prompt holds an assistant message with a remembered key, the message is
rendered as its raw text (the template sees ``{"role": "assistant", "content": <placeholder>}``)
and its token ids are spliced in where the placeholder lands: the prompt's ids are the
tokenizer's ids of the text between the spliced turns plus each turn's generated ids. Turn N+1's
ids then extend turn N's prompt ids plus its output ids, token for token, whatever the template.

The same message can come from several conversations (two agents asking for the same city get
the same call) with different ids: where the model chose the split, it depends on the context.
So each turn is also remembered under the prompt text it was generated from, and the splice
takes, for each placeholder, the turn generated after exactly the text that precedes it (the
conversation's own ids); only when no such turn is known (a template that renders the history
differently from the prompt it generated after) the latest turn with that message is used.

Not remembered: outputs with a reasoning split (templates such as Qwen3's drop past thinking, so
the prefix cannot extend the output anyway), and outputs whose ids do not decode to their text
(a stop string cut the text). Bound: ``max_entries`` turns in each table (least recently used
dropped first), their ids kept as int32 arrays.
"""
from __future__ import annotations

import hashlib
from array import array
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

_OPEN, _CLOSE = "\ue000sglite-turn-", "\ue001"  # private-use characters: never in a real prompt


def _norm_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def message_key(content: Optional[str], calls: Sequence[tuple[str, Any]]) -> str:
    """The memory key of an assistant message: ``content`` (stripped; None is "") and its calls
    ``[(name, arguments)]`` (arguments a JSON string or object, compared as parsed JSON)."""
    blob = json.dumps([(content or "").strip(), [[n, _norm_args(a)] for n, a in calls]], sort_keys=True,
                      ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _calls_of(msg: dict) -> list[tuple[str, Any]]:
    out = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function", c)
        out.append((fn.get("name"), fn.get("arguments")))
    return out


@dataclass
class Segment:
    """One remembered assistant turn placed in a prompt: its raw text and generated token ids."""

    text: str
    ids: array  # int32 token ids (4 bytes each: 4,096 turns of 8k tokens stay ~130 MB)
    key: str = ""  # the message's key (:func:`message_key`)


def _text_hash(text: str = ""):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass"))


def context_key(key: str, prompt_hash) -> str:
    """The key of a turn with message key ``key`` generated after the prompt text hashed in
    ``prompt_hash`` (a sha256 object over its UTF-8 bytes, :func:`_text_hash`; not changed)."""
    h = prompt_hash.copy()
    h.update(b"\0" + key.encode())
    return h.hexdigest()


class TurnTokens:
    """The remembered assistant turns (see the module docstring).

    Args:
        tokenizer: the engine's tokenizer (``encode(text) -> ids``, ``decode(ids) -> text``).
        max_entries: turns remembered (>= 0; 0 turns the memory off).
    Raises:
        ValueError: ``max_entries`` < 0.
    """

    def __init__(self, tokenizer, max_entries: int = 4096):
        if max_entries < 0:
            raise ValueError(f"max_entries: must be >= 0, got {max_entries}")
        self.tokenizer, self.max_entries = tokenizer, max_entries
        self._items: OrderedDict[str, Segment] = OrderedDict()     # message key -> the latest turn
        self._by_context: OrderedDict[str, Segment] = OrderedDict()  # context_key -> the turn
        self._gaps: OrderedDict[str, array] = OrderedDict()  # text between turns -> its ids
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def remember(self, content: Optional[str], calls: Sequence[tuple[str, Any]], text: str,
                 output_ids: Optional[Sequence[int]], prompt: Optional[str] = None) -> bool:
        """Remember one generated turn: the parsed message (``content``, ``calls``) the client
        will send back, the output ``text`` and its ``output_ids``, and the ``prompt`` text it was
        generated after (None: kept only as the latest turn of its message). A trailing stop token
        that is not in the text (an end-of-turn token: the template writes it after the content)
        is left out. Returns False (nothing kept) when the ids do not decode to ``text``."""
        if self.max_entries == 0 or not output_ids or not text:
            return False
        ids = list(output_ids)
        for cand in (ids[:-1], ids):  # a last token the text does not show is the template's to write
            if cand and text in (self.tokenizer.decode(cand), self.tokenizer.decode(cand, skip_special_tokens=False)):
                break
        else:
            return False
        key = message_key(content, calls)
        seg = Segment(text, array("i", cand), key)
        with self._lock:
            for table, k in ((self._items, key), (self._by_context, None if prompt is None else context_key(key, _text_hash(prompt)))):
                if k is None:
                    continue
                table.pop(k, None)
                table[k] = seg
                while len(table) > self.max_entries:
                    table.popitem(last=False)
        return True

    def lookup(self, msg: dict) -> Optional[Segment]:
        """The remembered turn of an assistant message dict (``content``, ``tool_calls`` in
        chat-completions shape), or None."""
        if msg.get("role") != "assistant" or msg.get("reasoning_content"):
            return None
        key = message_key(msg.get("content"), _calls_of(msg))
        with self._lock:
            seg = self._items.get(key)
            if seg is not None:
                self._items.move_to_end(key)
            return seg

    def _in_context(self, seg: Segment, preceding) -> Segment:
        """The turn of ``seg``'s message generated after exactly the text hashed in ``preceding``
        (a sha256 object), else ``seg``."""
        ck = context_key(seg.key, preceding)
        with self._lock:
            own = self._by_context.get(ck)
            if own is not None:
                self._by_context.move_to_end(ck)
        return own or seg

    def substitute(self, messages: list[dict], keep_last: bool = False) -> tuple[list[dict], list[Segment]]:
        """Copies of ``messages`` where each remembered assistant message is a placeholder (its
        ``content`` a marker, no ``tool_calls``), and the remembered turns in order. ``keep_last``:
        leave the last message alone (``continue_final_message``)."""
        out, segs = [], []
        for i, m in enumerate(messages):
            seg = None if keep_last and i == len(messages) - 1 else self.lookup(m)
            if seg is None:
                out.append(m)
                continue
            rest = {k: v for k, v in m.items() if k not in ("content", "tool_calls", "reasoning_content")}
            out.append({**rest, "content": f"{_OPEN}{len(segs)}{_CLOSE}"})
            segs.append(seg)
        return out, segs

    def splice(self, rendered: str, segments: Sequence[Segment]) -> Optional[tuple[str, list[int]]]:
        """``(prompt text, prompt ids)`` of a prompt rendered from :meth:`substitute`'s messages:
        each placeholder replaced by its turn's raw text (and ids), the text between them
        tokenized; each turn is the one generated after exactly the text before it, where known
        (see the module docstring). None when a placeholder is missing, repeated or out of order
        (the template dropped or moved a message: render the messages as they are instead)."""
        texts, turns, pos, so_far = [], [], 0, _text_hash()
        for i, seg in enumerate(segments):
            mark = f"{_OPEN}{i}{_CLOSE}"
            at = rendered.find(mark, pos)
            if at < 0 or rendered.find(mark, at + 1) >= 0:
                return None
            texts.append(rendered[pos:at])
            so_far.update(texts[-1].encode("utf-8", "surrogatepass"))
            seg = self._in_context(seg, so_far)
            texts.append(seg.text)
            so_far.update(seg.text.encode("utf-8", "surrogatepass"))
            turns.append(seg.ids)
            pos = at + len(mark)
        tail = rendered[pos:]
        if _OPEN in tail:
            return None
        texts.append(tail)
        encoded = self._encode_many(texts[0::2])  # the text between the turns, tokenized in one call
        ids: list[int] = []
        for gap_ids, turn in zip(encoded, turns):
            ids += gap_ids
            ids += turn
        ids += encoded[-1]
        return "".join(texts), ids

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text between turns, each tokenized on its own (so the same text gives
        the same ids in any prompt): from a cache of the last ``max_entries`` such texts (an
        agent's system prompt and tool list come back every turn), the rest in one tokenizer call."""
        out: list = [None] * len(texts)
        with self._lock:
            for i, t in enumerate(texts):
                hit = self._gaps.get(t)
                if hit is not None:
                    self._gaps.move_to_end(t)
                    out[i] = list(hit)
        todo = [i for i, v in enumerate(out) if v is None]
        many = getattr(self.tokenizer, "encode_many", None)
        fresh = many([texts[i] for i in todo]) if many is not None else [self._encode(texts[i]) for i in todo]
        with self._lock:
            for i, ids in zip(todo, fresh):
                out[i] = ids
                if self.max_entries:
                    self._gaps[texts[i]] = array("i", ids)
            while len(self._gaps) > self.max_entries:
                self._gaps.popitem(last=False)
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text)) if text else []
