"""STANDALONE drafts: a small draft model with the target's tokenizer proposes greedy tokens.

The draft model has its own :class:`~sglite.runtime.model_runner.ModelRunner` (weights, a small
KV pool, page size 1, no radix cache) and keeps, per drafted request, the K/V of the sequence as
far as it has seen it. Each verify step it (1) rewinds a request's draft KV to the longest prefix
still equal to the request's sequence (drafts the target rejected are dropped, their slots freed),
(2) catches up on the tokens it has not seen (one extend, batched over requests) and (3) runs
``speculative_num_steps`` greedy steps (decode rows, batched) — the draft tokens. Greedy drafts are
point masses, so verification (:mod:`.verify`) stays exact whatever the draft model predicts.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from ...errors import InvalidRequestError
from ..forward_batch import ForwardBatch
from ..kv_manager import KVManager
from ..step_plan import StepEntry, StepPlan

log = logging.getLogger("sglite.speculative")


@dataclass
class _DraftKV:
    row: int
    kv_len: int = 0
    slots: list = field(default_factory=list)  # [alloc] slot of each position
    tokens: list = field(default_factory=list)  # tokens of positions 0..kv_len-1 (+ ones being computed)


class _Params:
    max_new_tokens = 1


class _Row:
    """What ``StepPlan`` / ``ForwardBatch.from_plan`` read of a request, for one draft forward."""

    params, finished = _Params(), None

    def __init__(self, st: _DraftKV):
        self.kv, self._st = st, st

    def tokens(self, a, b):
        return self._st.tokens[a:b]

    def token_at(self, i):
        return self._st.tokens[i]

    @property
    def seq_len(self):
        return len(self._st.tokens)

    def wants_input_logprobs(self):
        return False


class DraftModel:
    """A draft model and its per-request KV (see the module docstring).

    Args:
        runner: the draft's ``ModelRunner`` (``forward``, pools).
        num_steps: greedy steps per verify step.
    """

    def __init__(self, runner, num_steps: int):
        self.runner, self.num_steps = runner, num_steps
        self.states: dict = {}  # id(req) -> (req, _DraftKV)
        # the draft's own slot table is written through a KVManager (no radix cache: page size 1)
        self.kv = KVManager(runner.req_to_token_pool, runner.token_to_kv_pool, 1, disable_radix_cache=True)

    @classmethod
    def load(cls, config, target_runner) -> "DraftModel":
        """Load ``config.speculative_draft_model_path`` on the target's device and dtype, with a KV
        pool of the target's size. The draft's weights load as its own checkpoint says
        (``quantization`` auto: a ``.gguf`` draft keeps its Q4/Q8 blocks quantized whatever the
        target's ``quantization``), so a quantized copy of the target is a cheap draft
        (self-speculation). Raises InvalidRequestError (field ``speculative_draft_model_path``)
        when its vocabulary differs from the target's."""
        from ..model_loader import load_checkpoint
        from ..model_runner import ModelRunner
        from ..quant_loader import load_weights

        path = config.speculative_draft_model_path
        ckpt = load_checkpoint(path)
        dtype = str(target_runner.dtype).replace("torch.", "")
        # the draft's own KV in the model dtype: its rows run ahead and roll back every step,
        # which an int8 / int4 pool's key groups would not survive (a small model: small KV)
        cfg = dataclasses.replace(config, model_path=path, dtype=dtype, page_size=1, speculative_algorithm=None,
                                  quantization="auto", kv_cache_dtype="auto",
                                  max_total_tokens=target_runner.max_total_tokens,
                                  context_length=target_runner.context_length)
        runner = ModelRunner(cfg, ckpt.hf_config, load_weights(ckpt, "auto", target_runner.dtype, target_runner.device))
        if runner.vocab_size != target_runner.vocab_size:
            raise InvalidRequestError(
                f"draft model vocabulary ({runner.vocab_size}) differs from the target's "
                f"({target_runner.vocab_size}); the draft needs the same tokenizer", field="speculative_draft_model_path")
        log.info("STANDALONE draft model %s: %d greedy steps per verify step", path, config.speculative_num_steps)
        return cls(runner, config.speculative_num_steps)

    # ------------------------------------------------------------------ KV of the draft
    def _free(self, st: _DraftKV) -> None:
        if st.slots:
            self.runner.token_to_kv_pool.free(torch.tensor(st.slots, dtype=torch.int64))
        self.runner.req_to_token_pool.free(st.row)

    def _gc(self) -> None:
        """Drop the draft KV of requests that finished or were retracted."""
        for key, (r, st) in list(self.states.items()):
            if r.finished is not None or r.kv.row is None:
                self._free(st)
                del self.states[key]

    def _rewind(self, st: _DraftKV, r) -> None:
        """Keep the longest computed prefix equal to ``r``'s sequence, short of its last token (the
        next draft forward needs that token's logits: a draft the target cut short, e.g. by the
        grammar walk ending a chain before a closing or forcing token, can leave the draft's KV
        covering the target's correction token too); free the slots after it."""
        m = min(st.kv_len, r.seq_len - 1)
        seq_tail = r.tokens(0, m)
        same = 0
        while same < m and st.tokens[same] == seq_tail[same]:
            same += 1
        st.kv_len = same
        if len(st.slots) > same:
            self.runner.token_to_kv_pool.free(torch.tensor(st.slots[same:], dtype=torch.int64))
            del st.slots[same:]
        st.tokens = st.tokens[:same] + r.tokens(same, r.seq_len)

    def _reserve(self, st: _DraftKV, n: int) -> bool:
        pool = self.runner.token_to_kv_pool
        last = st.slots[-1] if st.slots else None
        if len(st.slots) + n > self.runner.req_to_token_pool.max_context:
            return False
        got = pool.alloc_extend(last, len(st.slots), n)
        if got is None:
            return False
        self.kv.write_slots(st.row, len(st.slots), got)
        st.slots.extend(got.tolist())
        return True

    def _forward(self, rows: list[tuple[_DraftKV, int]]) -> list[int]:
        """One batched draft forward: each state computes its last ``n`` tokens; greedy next ids."""
        entries = [StepEntry(_Row(st), n, st.kv_len) for st, n in rows]
        plan = StepPlan(entries).layout()
        order = {id(e.req._st): i for i, e in enumerate(plan.sampling)}
        logits = self.runner.forward(ForwardBatch.from_plan(plan, self.runner.req_to_token_pool.req_to_token))
        for st, n in rows:
            st.kv_len += n
        nxt = logits.argmax(dim=-1).tolist()
        return [nxt[order[id(st)]] for st, _ in rows]

    # ------------------------------------------------------------------ drafts
    def propose(self, reqs: list, rooms: list[int]) -> list[list[int]]:
        """Greedy drafts of at most ``min(num_steps, room)`` tokens for each request (empty where
        the draft pool is short)."""
        self._gc()
        active: list[tuple[int, _DraftKV, int]] = []  # (index, state, k)
        for i, (r, room) in enumerate(zip(reqs, rooms)):
            k = min(self.num_steps, room, r.spec.cap if r.spec is not None else self.num_steps)
            if k < 1:
                continue
            entry = self.states.get(id(r))
            if entry is None:
                row = self.runner.req_to_token_pool.alloc()
                if row is None:
                    continue
                entry = self.states[id(r)] = (r, _DraftKV(row))
            st = entry[1]
            self._rewind(st, r)
            if not self._reserve(st, len(st.tokens) - st.kv_len + k - 1):
                self._free(st)
                del self.states[id(r)]
                continue
            active.append((i, st, k))
        drafts: list[list[int]] = [[] for _ in reqs]
        if not active:
            return drafts
        nxt = self._forward([(st, len(st.tokens) - st.kv_len) for _, st, _ in active])
        for step in range(max(k for _, _, k in active)):
            live = []
            for (i, st, k), t in zip(active, nxt):
                drafts[i].append(t)
                if len(drafts[i]) < k:
                    st.tokens.append(t)
                    live.append((i, st, k))
            if not live:
                break
            active = live
            nxt = self._forward([(st, 1) for _, st, _ in active])
        return drafts
