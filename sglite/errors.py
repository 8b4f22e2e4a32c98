"""Error types of sglite.

User errors raise :class:`SgliteError` subclasses. :class:`InvalidRequestError` and
:class:`GrammarError` are also ``ValueError`` so callers may catch either; the server maps
them to HTTP 400. :class:`CapacityError` means a request can never fit (e.g. a prompt longer
than the context or than the whole KV pool).
"""


class SgliteError(Exception):
    """Base class of every error sglite raises on purpose."""


class InvalidRequestError(SgliteError, ValueError):
    """A request or config field is invalid. The message names the field and the limit."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class GrammarError(SgliteError, ValueError):
    """A regex, JSON Schema or grammar cannot be compiled or enforced.

    The message names the construct (and, for JSON Schema, its JSON path).
    """


class CapacityError(InvalidRequestError):
    """A request can never fit: prompt + max_new_tokens exceed the context or the KV pool."""


class QueueFullError(SgliteError):
    """The waiting queue is full (``max_queued_requests``): try again later (HTTP 503 with
    ``Retry-After``). Nothing of the request was scheduled.

    Args:
        message: names the limit and its flag.
        retry_after: seconds a client should wait before retrying.
    """

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


CONTEXT_LENGTH_PREFIX = "this model's maximum context length is"


def context_length_message(prompt_tokens: int, context_length: int, max_new_tokens: int | None = None,
                           field: str = "max_new_tokens", prompt_field: str = "prompt") -> str:
    """The one wording of the context-length error, on every route and in the engine (close to
    OpenAI's ``context_length_exceeded`` text, which clients match on), led by the field at fault:
    ``prompt_field`` when the prompt alone does not fit, else ``field`` (the output budget)."""
    head = f"{CONTEXT_LENGTH_PREFIX} {context_length} tokens; the prompt has {prompt_tokens} tokens"
    if max_new_tokens is None:
        return f"{prompt_field}: {head}"
    return f"{field}: {head} and {field} asks for {max_new_tokens} more"
