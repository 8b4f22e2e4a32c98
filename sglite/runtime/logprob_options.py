"""LogprobOptions: what logprobs one request returns (one record instead of four loose arguments).

The public ``Engine.generate(..., return_logprob=, logprob_start_len=, top_logprobs_num=,
token_ids_logprob=)`` keywords (SGLang's names) are gathered here once, validated, and carried on
each ``Req`` as ``req.logprobs``. No torch: the server and the fake engine import it too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class LogprobOptions:
    """Logprob options of one request.

    Attributes:
        return_logprob: return ``[logprob, token_id, text]`` entries of the output tokens (and of
            the prompt tokens from ``logprob_start_len`` on).
        logprob_start_len: first prompt position whose logprob is returned; -1 = no prompt logprobs.
        top_logprobs_num: also return the top-k entries per position, k in [0, 20].
        token_ids_logprob: also return the logprobs of these token ids per position (or None).
    """

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[tuple[int, ...]] = None

    @classmethod
    def from_args(cls, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
                  token_ids_logprob=None, vocab_size: Optional[int] = None) -> "LogprobOptions":
        """Validated options from ``generate``'s keyword arguments (``logprob_start_len`` scalar).

        Raises:
            InvalidRequestError: naming the bad field (types, ``top_logprobs_num`` in [0, 20],
                token ids in ``[0, vocab_size)``, ``logprob_start_len >= -1``).
        """
        if not isinstance(return_logprob, bool):
            raise InvalidRequestError("return_logprob: must be true or false", field="return_logprob")
        if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs_num: must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                                      field="top_logprobs_num")
        if token_ids_logprob is not None and not isinstance(token_ids_logprob, (list, tuple)):
            raise InvalidRequestError("token_ids_logprob: must be a list of token ids", field="token_ids_logprob")
        for t in token_ids_logprob or []:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidRequestError(f"token_ids_logprob: {t!r} is not a token id", field="token_ids_logprob")
        if not _is_int(logprob_start_len) or logprob_start_len < -1:
            raise InvalidRequestError(f"logprob_start_len: must be -1 or >= 0, got {logprob_start_len!r}",
                                      field="logprob_start_len")
        ids = tuple(token_ids_logprob) if token_ids_logprob else None
        return cls(return_logprob, logprob_start_len, top_logprobs_num, ids)

    def with_start(self, logprob_start_len: int) -> "LogprobOptions":
        """The same options with another ``logprob_start_len`` (per prompt of a batch)."""
        return replace(self, logprob_start_len=logprob_start_len)

    def check_prompt(self, prompt_len: int) -> None:
        """Raise InvalidRequestError unless ``logprob_start_len`` is -1 or in ``[0, prompt_len]``."""
        st = self.logprob_start_len
        if st > prompt_len:
            raise InvalidRequestError(f"logprob_start_len: must be -1 or in [0, {prompt_len}], got {st!r}",
                                      field="logprob_start_len")

    @property
    def wants_input(self) -> bool:
        """True when prompt-token logprobs are returned."""
        return self.return_logprob and self.logprob_start_len >= 0

    def to_kwargs(self) -> dict:
        """The ``generate`` keyword arguments of these options (non-default ones only)."""
        if not self.return_logprob:
            return {}
        kw: dict = {"return_logprob": True, "logprob_start_len": self.logprob_start_len,
                    "top_logprobs_num": self.top_logprobs_num}
        if self.token_ids_logprob:
            kw["token_ids_logprob"] = list(self.token_ids_logprob)
        return kw


NO_LOGPROBS = LogprobOptions()
