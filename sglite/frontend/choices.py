"""Choice-selection methods for ``select`` (SGLang's ``sglang/lang/choices.py`` semantics).

Every method takes, per choice, the logprobs of the choice's tokens given the prompt and
returns a :class:`ChoicesDecision`. Token logprob entries are ``[logprob, token_id, text|None]``
lists (SGLang's ``input_token_logprobs`` shape). Ties always go to the first choice.

* ``token_length_normalized`` (default): argmax of the mean token logprob.
* ``greedy_token_selection``: compare position by position, keep the options holding the
  maximum; a shorter option is padded with its own mean logprob.
* ``unconditional_likelihood_normalized``: argmax of the mean of (conditional − unconditional)
  logprob per token; the first unconditional logprob (no context) counts as 0 when None.
  (Holtzman et al. 2021, "Surface Form Competition", PMI-style scoring.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ChoicesDecision:
    """The chosen string and the scores behind it (``meta_info`` is what ``get_meta_info`` returns)."""

    decision: str
    meta_info: dict = field(default_factory=dict)


def _argmax_first(values: list) -> int:
    if not values:
        raise ValueError("select: no choices to score")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:  # strict: ties keep the earlier choice
            best = i
    return best


def mean_logprob(entries: list) -> float:
    """Mean of the non-None logprobs of ``entries`` (``[lp, id, text]`` lists); -inf when none."""
    vals = [e[0] for e in entries if e[0] is not None]
    return sum(vals) / len(vals) if vals else -math.inf


class ChoicesMethod:
    """Base of the selection methods. Callable with keyword arguments; returns ChoicesDecision."""

    name = "base"
    requires_unconditional_logprobs = False

    def _meta(self, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs):
        return {"normalized_prompt_logprobs": list(normalized_prompt_logprobs),
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs}

    def __call__(self, *, choices: list, normalized_prompt_logprobs: list, input_token_logprobs: list,
                 output_token_logprobs: list, unconditional_token_logprobs: Optional[list] = None
                 ) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self):
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    """Pick the choice with the highest mean token logprob (SGLang's default)."""

    name = "token_length_normalized"

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None):
        best = _argmax_first(list(normalized_prompt_logprobs))
        return ChoicesDecision(choices[best], self._meta(normalized_prompt_logprobs, input_token_logprobs,
                                                         output_token_logprobs))


class GreedyTokenSelection(ChoicesMethod):
    """Position-by-position elimination; shorter options are padded with their mean logprob."""

    name = "greedy_token_selection"

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None):
        width = max((len(opt) for opt in input_token_logprobs), default=0)
        matrix = []
        for opt in input_token_logprobs:
            row = [e[0] if e[0] is not None else 0.0 for e in opt]
            pad = sum(row) / len(row) if row else -math.inf
            matrix.append(row + [pad] * (width - len(row)))
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """Mean of conditional minus unconditional token logprobs.

    Raises:
        ValueError: without unconditional logprobs, or when a choice's two lists differ in length.
    """

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(f"conditional ({len(cond)}) and unconditional ({len(uncond)}) token "
                                 f"logprobs must have the same length")
            diffs = []
            for c, u in zip(cond, uncond):
                u_lp = u[0] if u[0] is not None else 0.0
                c_lp = c[0] if c[0] is not None else 0.0
                diffs.append(c_lp - u_lp)
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        best = _argmax_first(scores)
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[best], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_METHODS = {m.name: m for m in (token_length_normalized, greedy_token_selection,
                                unconditional_likelihood_normalized)}


def resolve_choices_method(method: Any) -> ChoicesMethod:
    """A ChoicesMethod from an instance or its name.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if isinstance(method, str) and method in _METHODS:
        return _METHODS[method]
    raise ValueError(f"choices_method: unknown method {method!r}; known: {', '.join(sorted(_METHODS))}")
