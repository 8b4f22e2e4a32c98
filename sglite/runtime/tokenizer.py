"""Tokenizer wrapper: encode/decode, EOS ids, the chat template and the role markers it uses."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import InvalidRequestError

# Sentinel message contents used to read the role markers out of a chat template. Plain
# alphanumerics so that templates which ``trim`` or escape contents leave them intact.
_SENTINELS = {"system": "SGLITESENTINELSYS", "user": "SGLITESENTINELUSR", "assistant": "SGLITESENTINELAST"}


def resolve_chat_template(value: str, own: Any = None) -> str:
    """The Jinja text ``value`` stands for (``--chat-template``, as SGLang and vLLM take it).

    Tried in order: an existing file (its text); a name of one of the tokenizer's own templates
    (``own``: transformers keeps named templates as a dict, e.g. ``{"default": ..., "tool_use":
    ...}``; ``"default"`` also names a single unnamed template); inline Jinja text (contains
    ``{{`` or ``{%``).

    Raises:
        InvalidRequestError: none of these (field ``chat_template``, listing the known names).
    """
    path = Path(value)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise InvalidRequestError(f"chat_template: file {value!r} is empty", field="chat_template")
        return text
    named = dict(own) if isinstance(own, dict) else ({"default": own} if own else {})
    if value in named:
        return named[value]
    if "{{" in value or "{%" in value:
        return value
    raise InvalidRequestError(
        f"chat_template: {value!r} is not a file, a template name of this tokenizer "
        f"(names: {sorted(named) or 'none'}) or Jinja text", field="chat_template")


def check_text(text: str, field: str) -> None:
    """Refuse text no tokenizer can take: a lone surrogate (``"\\ud800"``, which JSON can carry)
    is not valid Unicode. Raises InvalidRequestError naming ``field``, the reason and the
    character's index, in our words rather than the tokenizers library's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{field}: not valid Unicode text ({exc.reason} at character {exc.start})",
                                  field=field) from None


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}


def _plain_fast_backend(hf) -> Any:
    """The ``tokenizers`` object behind ``hf`` when ``hf.decode(ids, skip_special_tokens=s,
    clean_up_tokenization_spaces=False)`` is exactly ``backend.decode(ids, skip_special_tokens=s)``:
    a transformers fast tokenizer whose class overrides neither ``decode`` nor ``_decode``. Else
    None (slow tokenizers, custom decoders, test doubles)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(hf)
    if (not isinstance(hf, PreTrainedTokenizerFast) or cls.decode is not PreTrainedTokenizerFast.decode
            or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    return getattr(hf, "backend_tokenizer", None)


def _fast_encode():
    """``PreTrainedTokenizerFast``'s ``encode`` (the batch path gives the same ids only for a
    tokenizer that does not override it)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.encode


class Tokenizer:
    """A Hugging Face tokenizer plus the facts the runtime needs about it.

    Attributes:
        hf: the underlying ``transformers`` tokenizer.
        vocab_size: width of the model's logits (``hf_config.vocab_size`` when a config is given,
            else ``len(hf)``); may exceed the number of real tokens (padding rows).
        eos_token_ids: every id that ends generation: the config's ``eos_token_id`` (int or list),
            the tokenizer's EOS, ``generation_config.json``'s EOS and the chat template's
            end-of-turn token (e.g. ``<|im_end|>``).
        special_token_ids: ids of special tokens (skipped by ``decode(skip_special_tokens=True)``).
    """

    def __init__(self, hf, hf_config=None, generation_eos: Iterable[int] = ()):
        self.hf = hf
        self.vocab_size = int(getattr(hf_config, "vocab_size", 0) or len(hf))
        specials = set(hf.all_special_ids)
        for tid, added in getattr(hf, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                specials.add(int(tid))
        self.special_token_ids = frozenset(specials)
        eos = _as_id_set(getattr(hf_config, "eos_token_id", None))
        eos |= _as_id_set(hf.eos_token_id)
        eos |= set(generation_eos)
        eot = self._end_of_turn_id()
        if eot is not None:
            eos.add(eot)
        self.eos_token_ids = frozenset(eos)
        self._backend = _plain_fast_backend(hf)

    @classmethod
    def from_dir(cls, model_dir: str | Path, hf_config=None, tokenizer_path: str | Path | None = None,
                 chat_template: str | None = None) -> "Tokenizer":
        """Load the tokenizer of an HF folder (see :func:`sglite.runtime.model_loader.load_checkpoint`).

        Args:
            model_dir: the model's folder (its ``generation_config.json`` adds EOS ids).
            hf_config: the model's HF config (vocabulary width, EOS ids), or None.
            tokenizer_path: load the tokenizer from this folder instead of ``model_dir``.
            chat_template: replaces the tokenizer's template (see :func:`resolve_chat_template`).

        Raises:
            InvalidRequestError: the folder has no loadable tokenizer (field ``model_path`` or
                ``tokenizer_path``), or ``chat_template`` names nothing usable.
        """
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        field, tok_dir = ("tokenizer_path", Path(tokenizer_path)) if tokenizer_path else ("model_path", model_dir)
        try:
            hf = AutoTokenizer.from_pretrained(str(tok_dir))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"{field}: no loadable tokenizer in {str(tok_dir)!r}: {exc}", field=field
            ) from exc
        if chat_template is not None:
            hf.chat_template = resolve_chat_template(chat_template, getattr(hf, "chat_template", None))
        gen_eos: set[int] = set()
        gen_file = model_dir / "generation_config.json"
        if gen_file.is_file():
            gen_eos = _as_id_set(json.loads(gen_file.read_text()).get("eos_token_id"))
        return cls(hf, hf_config=hf_config, generation_eos=gen_eos)

    # ----------------------------------------------------------------------------- encode/decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of each of ``texts`` (the same ids), in one call to the tokenizer: each
        call costs ~0.4 ms of fixed overhead, so a prompt spliced from many short pieces pays it
        once. Empty texts give empty lists."""
        if not texts:
            return []
        if _plain_fast_backend(self.hf) is None or type(self.hf).encode is not _fast_encode():
            return [self.encode(t, add_special_tokens) if t else [] for t in texts]
        got = self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return [list(ids) if t else [] for t, ids in zip(texts, got)]

    @cached_property
    def prompt_bos_id(self) -> int | None:
        """The BOS id a text prompt starts with, or None: set when the tokenizer's own post-processor
        prepends its ``bos_token_id`` (``add_special_tokens=True``; a GGUF's
        ``tokenizer.ggml.add_bos_token``, e.g. Gemma, Llama), as SGLang's and llama.cpp's prompt
        encoding do. None for tokenizers that add no BOS (SmolLM2, Qwen)."""
        bos = getattr(self.hf, "bos_token_id", None)
        if bos is None:
            return None
        with_special = self.hf.encode("a", add_special_tokens=True)
        plain = self.hf.encode("a", add_special_tokens=False)
        return int(bos) if with_special[:1] == [bos] and plain[:1] != [bos] else None

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt: :meth:`encode` with the tokenizer's BOS prepended when it
        adds one (:attr:`prompt_bos_id`) and the text does not already start with it (a chat
        template that writes ``<bos>`` itself gets exactly one)."""
        ids = self.encode(text)
        bos = self.prompt_bos_id
        if bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids``. No clean-up of spaces, so decoding is a pure function of the ids
        (what the incremental detokenizer relies on). ``spaces_between_special_tokens`` only
        matters for slow (Python) tokenizers."""
        if self._backend is not None:  # what hf.decode runs, without its per-call Python layers
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        kwargs = {}
        if not getattr(self.hf, "is_fast", True):
            kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False, **kwargs)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary strings (e.g. ``'Ġthe'`` for byte-level BPE)."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    @cached_property
    def _piece_reading(self) -> tuple[dict, bool]:
        """(byte-level BPE decoder table, whether the vocabulary is byte-level), read once."""
        from ..constrained.tokenizer_info import _byte_decoder

        pieces = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
        byte_level = sum(1 for p in pieces if p and "\u0120" in p) > 0.01 * max(len(pieces), 1)
        return _byte_decoder(), byte_level

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (OpenAI's logprob ``bytes``): a byte-level BPE piece's bytes, a
        byte-fallback ``<0xNN>`` piece's byte, part of a UTF-8 character included; a special
        token's text as UTF-8; ``b""`` for ids past the tokenizer."""
        from ..constrained.tokenizer_info import _piece_bytes

        if not 0 <= int(token_id) < len(self.hf):
            return b""
        piece = self.hf.convert_ids_to_tokens([int(token_id)])[0]
        if piece is None:
            return b""
        if int(token_id) in self.special_token_ids:
            return piece.encode("utf-8")
        dec, byte_level = self._piece_reading
        return _piece_bytes(piece, dec, byte_level) or b""

    def id_to_text(self, token_id: int) -> str:
        """Readable text of one token for logprob entries (special tokens kept; a partial UTF-8
        character shows as U+FFFD)."""
        return self.decode([int(token_id)], skip_special_tokens=False)

    # ----------------------------------------------------------------------------- chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the model's chat template;
        ``chat_template_kwargs`` are extra template variables (e.g. ``enable_thinking``).

        Raises:
            InvalidRequestError: the tokenizer has no chat template or the template rejects them.
        """
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("messages: this model's tokenizer has no chat template (none in its "
                                      "tokenizer files or its GGUF's tokenizer.chat_template); give one with "
                                      "chat_template (--chat-template)", field="messages")
        try:
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               **(chat_template_kwargs or {}))
        except Exception as exc:  # jinja raises TemplateError / TypeError / KeyError ...
            raise InvalidRequestError(f"messages: chat template failed: {exc}", field="messages") from exc

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    @cached_property
    def _markers(self) -> tuple[dict[str, tuple[str, str]], str, str | None]:
        """Role markers, end-of-turn string and default system prompt, read off the template by
        rendering conversations with sentinel contents and diffing the renders."""
        msgs = [{"role": r, "content": _SENTINELS[r]} for r in ("system", "user", "assistant")]
        markers: dict[str, tuple[str, str]] = {}
        prev = ""
        for i, msg in enumerate(msgs):
            full = self._render(msgs[: i + 1])
            if not full.startswith(prev):
                raise InvalidRequestError(
                    "chat_template: rendering is not incremental; cannot derive role markers",
                    field="chat_template")
            part = full[len(prev):]
            before, sep, after = part.partition(msg["content"])
            if not sep:
                raise InvalidRequestError(
                    f"chat_template: message content of role {msg['role']!r} is not rendered verbatim",
                    field="chat_template")
            markers[msg["role"]] = (before, after)
            prev = full
        end_of_turn = markers["assistant"][1].strip()
        # Default system prompt: what the template puts before the user turn when none is given.
        user_only = self._render([msgs[1]])
        head = user_only[: user_only.index(_SENTINELS["user"])]
        user_before = markers["user"][0]
        default_system = None
        sys_before, sys_after = markers["system"]
        if head.endswith(user_before):
            head = head[: len(head) - len(user_before)]
            if head.startswith(sys_before) and head.endswith(sys_after) and \
                    len(head) >= len(sys_before) + len(sys_after):
                default_system = head[len(sys_before): len(head) - len(sys_after)]
        return markers, end_of_turn, default_system

    def role_markers(self) -> dict[str, tuple[str, str]]:
        """``{role: (before, after)}`` for system/user/assistant: the text the chat template puts
        before and after a message's content (e.g. ``("<|im_start|>user\\n", "<|im_end|>\\n")``).

        Raises:
            InvalidRequestError: no chat template, or one whose output is not derivable this way.
        """
        return dict(self._markers[0])

    @property
    def end_of_turn(self) -> str:
        """The string that ends an assistant turn (e.g. ``"<|im_end|>"``), whitespace stripped."""
        return self._markers[1]

    @property
    def default_system_prompt(self) -> str | None:
        """The system prompt the template inserts when the messages have none, else None."""
        return self._markers[2]

    def _end_of_turn_id(self) -> int | None:
        """Id of the end-of-turn token if the chat template ends turns with one token."""
        if not getattr(self.hf, "chat_template", None):
            return None
        try:
            eot = self.end_of_turn
        except InvalidRequestError:
            return None
        ids = self.encode(eot) if eot else []
        return ids[0] if len(ids) == 1 else None

    def __repr__(self) -> str:
        return (f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={sorted(self.eos_token_ids)})")
