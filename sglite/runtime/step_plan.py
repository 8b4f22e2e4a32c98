"""StepPlan: what one scheduler step runs, as one record (built by the scheduler, read by
:meth:`ForwardBatch.from_plan` and by result processing).

Each :class:`StepEntry` extends one request by ``n`` tokens (``seq[start:start + n]``): a prefill
chunk, one sampled token (decode) or a jump-forward string. Entries that run as *extend* rows (more
than ``small_extend`` tokens, unless every token is forced onto decode rows) come first in the
batch, then the decode rows (one per token). :meth:`StepPlan.layout` numbers the logits rows: each
entry's input-logprob rows and its sampling row (the last token of a request that has caught up
with its sequence and still generates).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .req import Req

if TYPE_CHECKING:
    import torch

SMALL_EXTEND = 8  # extends of at most this many tokens (jump-forward, cached prompts) run as decode rows


@dataclass(eq=False)
class StepEntry:
    """One request's part of a step.

    Attributes:
        req: the request.
        n: tokens computed this step (>= 1).
        start: ``req.kv.kv_len`` when planned: the first computed token's position.
        decode_rows: the n tokens run as decode-attention rows (each with its own causal length).
        sample_row: logits row sampled for the next token, or None (a non-final prefill chunk).
        input_rows: [(prompt position, logits row)] whose logprobs the request asked for.
        draft: speculative draft tokens appended after the request's pending tokens (the last
            ``len(draft)`` of the ``n``); the entry then has ``len(draft) + 1`` logits rows from
            ``sample_row`` on, one per position from its last pending token (a verify step).
        tree: a ``speculative.tree.TreeDraft`` when the draft tokens form a token tree (their
            positions and attention rows then come from it; always decode rows), else None.
        skip_rows: of the ``len(draft) + 1`` verify rows (0: the last pending token, then the
            draft tokens in layout order), those whose logits nobody reads (the row before a
            draft token that is forced text): left out of the step's logits rows, so the LM head
            does not compute them; :meth:`verify_rows` puts zero rows in their place.
    """

    req: Req
    n: int
    start: int
    decode_rows: bool = False
    sample_row: Optional[int] = None
    input_rows: list[tuple[int, int]] = field(default_factory=list)
    draft: tuple = ()
    tree: Optional[object] = None
    skip_rows: frozenset = frozenset()

    def verify_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """This verify entry's ``len(draft) + 1`` logits rows out of the step's ``logits``
        ([M, V] float32, rows from :attr:`sample_row` on), zeros at :attr:`skip_rows`."""
        n = len(self.draft) + 1
        got = logits[self.sample_row:self.sample_row + n - len(self.skip_rows)]
        if not self.skip_rows:
            return got
        full = got.new_zeros((n, got.shape[1]))
        full[[j for j in range(n) if j not in self.skip_rows]] = got
        return full

    @property
    def ends_sequence(self) -> bool:
        return self.start + self.n - len(self.draft) == self.req.seq_len


@dataclass
class StepPlan:
    """The entries of one step, extend entries first. ``decode_only``: a decode-priority step."""

    entries: list[StepEntry]
    decode_only: bool = False
    #: entries that sample a token, in logits-row order, and their requests (the sampler's and the
    #: masks' rows); set by :meth:`layout`
    sampling: list[StepEntry] = field(default_factory=list)
    sampling_reqs: list[Req] = field(default_factory=list)
    #: entries with speculative drafts (verified by ``sglite.runtime.speculative``, not sampled)
    verifying: list[StepEntry] = field(default_factory=list)

    @property
    def has_chunk(self) -> bool:
        return any(e.req.prefilling for e in self.entries)

    @property
    def has_decode(self) -> bool:
        return any(not e.req.prefilling for e in self.entries)

    def layout(self, small_extend: Optional[int] = SMALL_EXTEND) -> "StepPlan":
        """Order the entries (extend entries first, stable), number their logits rows and fill
        :attr:`sampling` / :attr:`sampling_reqs`.

        ``small_extend``: entries of at most this many tokens run as decode rows; None runs every
        token as a decode row (deterministic inference: one attention kernel for every token, so a
        token's result does not depend on chunking or on the batch). Returns self.
        """
        for e in self.entries:
            # a verify step (draft tokens after at most ``small_extend`` pending ones) is decode rows
            # too: each row attends to the rows before it, as an extend would, and a CPU step of
            # only decode rows takes the fused decode (sglite/kernels/decode_fused.py), whose rows are
            # computed as the plain run's decode rows are
            e.decode_rows = small_extend is None or e.n <= small_extend or e.tree is not None or bool(e.draft)
        self.entries.sort(key=lambda e: e.decode_rows)
        row = 0
        for e in self.entries:
            r = e.req
            e.input_rows = []
            if r.wants_input_logprobs():
                lo = max(e.start, r.logprob_start_len - 1, 0)
                hi = min(e.start + e.n, len(r.input_ids) - 1)
                e.input_rows = [(p + 1, row + i) for i, p in enumerate(range(lo, hi))]
                row += len(e.input_rows)
            e.sample_row = None
            if e.ends_sequence and r.params.max_new_tokens > 0 and r.finished is None:
                e.sample_row = row
                row += 1 + len(e.draft) - len(e.skip_rows)
        self.sampling = [e for e in self.entries if e.sample_row is not None and not e.draft]
        self.verifying = [e for e in self.entries if e.sample_row is not None and e.draft]
        self.sampling_reqs = [e.req for e in self.sampling]
        return self

    def logits_offsets(self) -> list[int]:
        """Index into the step's tokens of every logits row, in row order."""
        out, offset = [], 0
        for e in self.entries:
            if e.input_rows:
                out.extend(offset + p - 1 - e.start for p, _ in e.input_rows)
            if e.sample_row is not None and not e.draft and not e.skip_rows:  # the usual row: its last token
                out.append(offset + e.n - 1)
            elif e.sample_row is not None:
                first = offset + e.n - 1 - len(e.draft)
                out.extend(first + j for j in range(len(e.draft) + 1) if j not in e.skip_rows)
            offset += e.n
        return out
