"""Chat template (role markers) and the text assembler that renders roles into the prompt.

The backend supplies the template from the model: ``model_info()`` (in-process engine) or
``GET /get_model_info`` (HTTP) carry ``"role_markers": {role: [prefix, suffix]}``,
``"end_of_turn"`` and ``"default_system_prompt"``. Rendering follows SGLang's interpreter
(``_execute_role_begin/_end``): the prefix is appended when a role opens, the suffix when it
closes, and ``{"role", "content"}`` (content = text written inside the role, left-stripped) is
recorded. When the first role opened is not ``system`` and the template has a default system
prompt, a system turn is inserted first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from sglite.errors import InvalidRequestError

ROLES = ("system", "user", "assistant")


def role_transition(open_role: Optional[str], role: str, begin: bool) -> Optional[str]:
    """The role open after ``role``'s begin (``begin``) or end, given the ``open_role`` before.

    One rule for the assembler and for the checks made before anything is sent.

    Raises:
        InvalidRequestError: an unknown role, a role opened inside another (nested roles), or an
            end that does not match the open role (``field="role"``).
    """
    if begin:
        if role not in ROLES:
            raise InvalidRequestError(f"role must be one of {ROLES}, got {role!r}", field="role")
        if open_role is not None:
            raise InvalidRequestError(f"Nested roles are not allowed: {role!r} opened inside "
                                      f"{open_role!r}", field="role")
        return role
    if open_role != role:
        raise InvalidRequestError(f"{role}_end() without a matching {role}_begin() "
                                  f"(open role: {open_role!r})", field="role")
    return None


@dataclass(frozen=True)
class ChatContext:
    """What a message-based backend (an OpenAI-compatible chat API) needs at a gen or select:
    the finished ``messages`` (``{"role", "content"}``), the open ``role`` (None outside one) and
    the ``partial`` content already written in it."""

    messages: list
    role: Optional[str]
    partial: str


@dataclass(frozen=True)
class ChatTemplate:
    """Role markers of a model's chat format.

    ``role_markers`` maps a role to ``(prefix, suffix)``; a role missing from it renders with
    empty markers. ``end_of_turn`` (e.g. ``"<|im_end|>"``) becomes a stop string of every gen
    inside a role.
    """

    role_markers: dict = field(default_factory=dict)
    end_of_turn: Optional[str] = None
    default_system_prompt: Optional[str] = None

    @classmethod
    def from_model_info(cls, info: dict) -> "ChatTemplate":
        """Build from a ``model_info`` dict; missing keys give a template with no markers."""
        markers = {r: (str(v[0]), str(v[1])) for r, v in (info.get("role_markers") or {}).items()}
        return cls(markers, info.get("end_of_turn") or None, info.get("default_system_prompt") or None)

    def prefix(self, role: str) -> str:
        """Text appended when ``role`` opens."""
        return self.role_markers.get(role, ("", ""))[0]

    def suffix(self, role: str) -> str:
        """Text appended when ``role`` closes."""
        return self.role_markers.get(role, ("", ""))[1]


class TextAssembler:
    """The program text and messages, built op by op. Not thread-safe (one owner at a time).

    ``on_append(delta)`` is called for every piece of text appended, so a stream of the deltas
    joins to exactly :attr:`text`.
    """

    def __init__(self, template: ChatTemplate, on_append: Optional[Callable[[str], None]] = None):
        self.template = template
        self.text = ""
        self.messages: list = []
        self.cur_role: Optional[str] = None
        self._role_start = 0
        self._on_append = on_append

    def copy(self, on_append=None) -> "TextAssembler":
        """An independent copy (for fork branches)."""
        other = TextAssembler(self.template, on_append)
        other.text, other.messages = self.text, [dict(m) for m in self.messages]
        other.cur_role, other._role_start = self.cur_role, self._role_start
        return other

    def append(self, delta: str) -> None:
        """Append text (mutates)."""
        if delta:
            self.text += delta
            if self._on_append is not None:
                self._on_append(delta)

    def open_turn(self) -> tuple:
        """``(role, content so far)`` of the open turn (left-stripped, as it would be recorded),
        or ``(None, "")`` outside a role."""
        if self.cur_role is None:
            return None, ""
        return self.cur_role, self.text[self._role_start:].lstrip()

    def role_begin(self, role: str) -> None:
        """Open ``role``.

        Raises:
            InvalidRequestError: if a role is already open (nested roles) or the role is unknown.
        """
        role_transition(self.cur_role, role, True)
        t = self.template
        if not self.messages and role != "system" and t.default_system_prompt:
            self._open("system")
            self.append(t.default_system_prompt)
            self.role_end("system")
        self._open(role)

    def _open(self, role: str) -> None:
        self.append(self.template.prefix(role))
        self.cur_role, self._role_start = role, len(self.text)

    def role_end(self, role: str) -> None:
        """Close ``role``: append its suffix and record the message.

        Raises:
            InvalidRequestError: if ``role`` is not the open role.
        """
        role_transition(self.cur_role, role, False)
        content = self.text[self._role_start:].lstrip()
        self.append(self.template.suffix(role))
        self.messages.append({"role": role, "content": content})
        self.cur_role = None
