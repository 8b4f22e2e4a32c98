"""Perplexity of a model (any engine configuration: dtype, quantization...) over a fixed local text.

The text: CPython's ``pydoc_data.topics`` (the help topics of the running interpreter's stdlib:
human-written English with code, on every machine, nothing downloaded). :func:`topics_text` joins
``topics[k]`` for the keys in sorted order; :func:`text_token_ids` takes its first ``max_tokens``
tokens (tokenizer without special tokens). The text differs between Python versions, so reports
carry the version and a SHA-256 of the token ids used.

Windows (the strided evaluation of HF transformers' perplexity guide): windows of ``context_length``
tokens start every ``stride`` tokens; each window scores only the tokens the previous windows did
not (its last ``end - prev_end`` tokens, never its own first token), each conditioned on
up to ``context_length - 1`` preceding tokens of its window. Perplexity = ``exp(mean NLL)`` over all
scored tokens (natural log). ``stride == context_length`` gives disjoint windows.

Scoring goes through the engine's prompt-logprob path (``Engine.generate(input_ids=...,
return_logprob=True, logprob_start_len=..., max_new_tokens=0)``), every window one request, all
submitted as one batch.
"""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, dataclass

DEFAULT_MAX_TOKENS = 8192
DEFAULT_CONTEXT_LENGTH = 1024
DEFAULT_STRIDE = 512


def topics_text() -> str:
    """The evaluation text: ``pydoc_data.topics.topics`` values joined in sorted-key order (str)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def text_token_ids(tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[int]:
    """The first ``max_tokens`` token ids of :func:`topics_text` (``tokenizer.encode(text,
    add_special_tokens=False)``; only a prefix of the text long enough is tokenized).

    Raises:
        ValueError: ``max_tokens`` < 2 or more tokens than the text has.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens: must be >= 2, got {max_tokens}")
    text = topics_text()
    chars = 8 * max_tokens
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > max_tokens or chars >= len(text):  # one spare token: the cut cannot move the slice
            break
        chars *= 2
    if len(ids) < max_tokens:
        raise ValueError(f"max_tokens: the text has only {len(ids)} tokens, asked {max_tokens}")
    return ids[:max_tokens]


def windows(n: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` per window over ``n`` tokens: the window is ``ids[begin:end]``
    and it scores positions ``first_scored .. end-1`` (absolute). With ``stride < context_length``
    every position 1..n-1 is scored exactly once; with ``stride == context_length`` (disjoint
    windows) a window's first token is not scored (no context), as in HF's recipe.

    Raises:
        ValueError: ``context_length`` < 2, ``stride`` not in [1, context_length].
    """
    if context_length < 2:
        raise ValueError(f"context_length: must be >= 2, got {context_length}")
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride: must be in [1, context_length={context_length}], got {stride}")
    out, prev_end, begin = [], 0, 0
    while prev_end < n:
        end = min(begin + context_length, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        begin += stride
    return out


@dataclass
class PerplexityResult:
    """Perplexity of one run. ``nll``: mean negative log-likelihood (nats / token) over ``n_scored``
    tokens; ``perplexity = exp(nll)``; ``tokens_sha256``: SHA-256 of the token ids (comma-joined
    decimal) so runs on the same text can be matched."""

    perplexity: float
    nll: float
    n_scored: int
    n_tokens: int
    n_windows: int
    context_length: int
    stride: int
    python_version: str
    tokens_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def window_logprobs(engine, ids: list[int], context_length: int, stride: int) -> list[float]:
    """Log-probabilities (nats) of tokens ``ids[1:]`` in order, each scored once by the engine
    under the window scheme of :func:`windows`."""
    wins = windows(len(ids), context_length, stride)
    outs = engine.generate(input_ids=[ids[b:e] for b, e, _ in wins],
                           sampling_params=[{"max_new_tokens": 0, "temperature": 0.0}] * len(wins),
                           return_logprob=True, logprob_start_len=[f - b for b, _, f in wins])
    lps: list[float] = []
    for (b, e, f), o in zip(wins, outs):
        entries = [x for x in o["meta_info"]["input_token_logprobs"] if x[0] is not None]
        if len(entries) != e - f:
            raise RuntimeError(f"perplexity: window [{b}, {e}) returned {len(entries)} prompt logprobs, "
                               f"expected {e - f}")
        for (lp, tid, _), want in zip(entries, ids[f:e]):
            if tid != want:
                raise RuntimeError(f"perplexity: logprob of token {tid} returned where {want} was expected")
            lps.append(float(lp))
    return lps


def perplexity(engine, ids: list[int], context_length: int = DEFAULT_CONTEXT_LENGTH,
               stride: int = DEFAULT_STRIDE) -> PerplexityResult:
    """Perplexity of ``engine``'s model over token ids ``ids`` (see the module docstring).

    Raises:
        ValueError: bad ``context_length`` / ``stride`` (see :func:`windows`), fewer than 2 ids.
    """
    if len(ids) < 2:
        raise ValueError(f"ids: need at least 2 tokens, got {len(ids)}")
    lps = window_logprobs(engine, ids, context_length, stride)
    nll = -math.fsum(lps) / len(lps)
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, n_scored=len(lps), n_tokens=len(ids),
                            n_windows=len(windows(len(ids), context_length, stride)),
                            context_length=context_length, stride=stride,
                            python_version=sys.version.split()[0], tokens_sha256=tokens_digest(ids))


def build_parser():
    """``sglite eval perplexity`` flags: the text slice and windows, plus every engine flag."""
    from ..flags import FlagParser, add_engine_args

    p = FlagParser(prog="sglite eval perplexity",
                   description="Perplexity over the first --max-tokens tokens of CPython's pydoc_data "
                   "topics text, windows of --window-length tokens every --stride tokens, scored "
                   "through the engine's prompt logprobs (flags are checked before the model loads).")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens of the text to evaluate (default: {DEFAULT_MAX_TOKENS})")
    p.add_argument("--window-length", type=int, default=DEFAULT_CONTEXT_LENGTH,
                   help=f"tokens per window (default: {DEFAULT_CONTEXT_LENGTH})")
    p.add_argument("--stride", type=int, default=DEFAULT_STRIDE,
                   help=f"tokens between window starts (default: {DEFAULT_STRIDE})")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: off)")
    add_engine_args(p)
    return p


def main(argv=None) -> int:
    """``sglite eval perplexity``: prints perplexity (or the JSON of :class:`PerplexityResult`)."""
    import json

    from ..flags import engine_kwargs, fail
    from ..runtime.engine_config import engine_config

    p = build_parser()
    args = p.parse_args(argv)
    kwargs = engine_kwargs(args)
    try:
        engine_config(**kwargs)
        windows(args.max_tokens, args.window_length, args.stride)
        if args.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2, got {args.max_tokens}")
    except ValueError as exc:
        fail(p, exc)
    from ..logging_setup import configure
    from ..runtime.engine import Engine

    configure(kwargs.get("log_level", "warning"))
    with Engine(**kwargs) as e:
        ids = text_token_ids(e.tokenizer, args.max_tokens)
        res = perplexity(e, ids, args.window_length, args.stride)
        model = e.runner.model
        weight_bytes = model.resident_weight_bytes() if hasattr(model, "resident_weight_bytes") else None
    if args.json:
        print(json.dumps({**res.to_dict(), "resident_weight_bytes": weight_bytes,
                          "model_path": kwargs.get("model_path"), "quantization": kwargs.get("quantization")},
                         indent=2))
    else:
        print(f"perplexity {res.perplexity:.4f} (nll {res.nll:.5f} nats/token over {res.n_scored} tokens, "
              f"{res.n_windows} windows of {res.context_length} stride {res.stride}, Python {res.python_version})")
    return 0
