"""What a chat template does with tools, learned once per server and reused on every request.

Two facts decide how :func:`sglite.server.tool_calls.render_prompt` renders a tools request:

* whether the template shows the ``tools`` it is given (Qwen, Llama 3.x, Mistral do; SmolLM2's
  ChatML drops them, and the server then writes them into a system message itself);
* whether the template renders past assistant ``tool_calls`` (else they are kept as text).

Both are properties of the template (and of the request's ``chat_template_kwargs``), not of a
conversation's content, so they are judged on small probe messages and cached: an agent that
resends its whole history on every turn then pays for one render of that history, not three.
The tools themselves are part of the key (a template may show some tool shapes and not others).
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Callable, Optional

#: the name of the probe function (never a real tool's name in practice)
PROBE_NAME = "sglite_probe_function"


class TemplateFacts:
    """A bounded cache of what one server's chat template does (see the module docstring).

    Args:
        max_entries: facts kept (least recently used dropped first); one entry per distinct
            (tool list, system message or not, template kwargs) seen, so agents reuse a few.
    Thread-safe: the preparation pool's workers share one instance.
    """

    def __init__(self, max_entries: int = 256):
        self.max_entries = int(max_entries)
        self._facts: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, key, compute: Callable[[], bool]) -> bool:
        with self._lock:
            if key in self._facts:
                self._facts.move_to_end(key)
                return self._facts[key]
        value = compute()  # outside the lock: a template render
        with self._lock:
            self._facts[key] = value
            while len(self._facts) > self.max_entries:
                self._facts.popitem(last=False)
        return value

    def shows_tools(self, render: Callable[..., str], tools: list[dict], messages: list[dict],
                    template_kwargs: Optional[dict] = None) -> Optional[bool]:
        """True when ``render(messages, tools=...)`` (the engine's ``apply_chat_template`` with the
        request's kwargs bound) lists every tool's name beyond what the same probe messages give
        without tools; None when the template rejects the probe (the caller then judges on the
        request's own messages).

        The probe mirrors the shape of ``messages`` that templates place tools by: the first
        message's role, whether a user message is present (Mistral's template lists tools before
        the last user message, Llama 3.1's in the first one) and the last message's role; the
        verdict is cached under that shape, the tools and the kwargs."""
        roles = [m.get("role") for m in messages]
        shape = (roles[0] if roles else None, "user" in roles, roles[-1] if roles else None)
        blob = json.dumps([tools, shape, template_kwargs], sort_keys=True, default=str)
        key = ("tools", hashlib.sha256(blob.encode()).hexdigest())
        probe = [{"role": r, "content": "x"} for r in _probe_roles(*shape)]
        names = [t["function"]["name"] for t in tools]

        def compute():
            try:
                text, plain = render(probe, tools=tools), render(probe)
            except Exception:  # noqa: BLE001 - a template that needs other messages: judged per request
                return None
            return all(name_count(text, n) > name_count(plain, n) for n in names)
        return self._get(key, compute)

    def renders_calls(self, render: Callable[..., str]) -> bool:
        """True when the template renders an assistant message's ``tool_calls`` (a probe call's
        name appears); False when it drops them or rejects the probe."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": PROBE_NAME, "arguments": {}}}]}]

        def compute():
            try:
                return PROBE_NAME in render(probe, add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - a template that rejects the probe keeps messages as given
                return True
        return self._get(("calls",), compute)


def _probe_roles(first: Optional[str], has_user: bool, last: Optional[str]) -> list[str]:
    """The roles of a probe conversation of the given shape (first role, a user message or not,
    last role), consecutive repeats merged."""
    roles = [r for r in (first, "user" if has_user else None, last) if r is not None]
    out = [r for i, r in enumerate(roles) if i == 0 or r != roles[i - 1]]
    return out or ["user"]


def name_count(text: str, name: str) -> int:
    """How often a tool's ``name`` occurs in rendered ``text``, as written or JSON-escaped (a
    template that lists tools through ``tojson`` escapes quotes, backslashes and non-ASCII)."""
    forms = {name, json.dumps(name)[1:-1], json.dumps(name, ensure_ascii=False)[1:-1]}
    return max(text.count(f) for f in forms)
