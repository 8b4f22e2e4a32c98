"""Output events (deltas of one request) and how they become the engine's output dicts (no torch).

The scheduler emits deltas (new text piece, new ids, new logprob entries). ``generate`` returns
SGLang's cumulative dicts (``text`` = everything so far); with ``incremental=True`` a stream gets
the deltas themselves (SGLang's ``--incremental-streaming-output``, per call), which is what the
OpenAI routes send as SSE. Both views of one request join to the same final output.
"""
from __future__ import annotations

from dataclasses import dataclass

LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                 "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


@dataclass
class OutputEvent:
    """One event of one request: what is new since its previous event.

    Attributes:
        text: text released since the previous event (a delta, never cumulative).
        output_ids: output token ids since the previous event.
        meta_info: SGLang's ``meta_info`` keys with scalar values for the whole request so far
            (``id``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``
            (None while running), ``e2e_latency``, ``ttft``) and, when logprobs were asked, the
            NEW entries of each logprob list (see ``LOGPROB_LISTS``).
    """

    text: str
    output_ids: list
    meta_info: dict

    @property
    def finished(self) -> bool:
        return self.meta_info["finish_reason"] is not None

    def as_dict(self) -> dict:
        """The event in SGLang's output-dict shape (incremental: text/ids/lists are the new parts)."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta_info)}


class OutputAccumulator:
    """The cumulative output of one request, built from its events in order."""

    def __init__(self):
        self.text = ""
        self.output_ids: list[int] = []
        self.lists: dict[str, list] = {}

    def add(self, ev: OutputEvent) -> dict:
        """Fold ``ev`` in; return the cumulative output dict so far (fresh lists: safe to keep)."""
        self.text += ev.text
        self.output_ids.extend(ev.output_ids)
        meta = dict(ev.meta_info)
        for name in LOGPROB_LISTS:
            if name in meta:
                acc = self.lists.setdefault(name, [])
                acc.extend(meta[name])
                meta[name] = list(acc)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class BatchView:
    """Turns the events of one call's outputs (output index, event) into the dicts callers see.

    Args:
        num_outputs: outputs of the call (prompts x n); with more than one, dicts get ``index``.
        incremental: give each stream event's delta instead of the cumulative output.
    """

    def __init__(self, num_outputs: int, incremental: bool = False):
        self.num_outputs, self.incremental = num_outputs, incremental
        self._acc = [] if incremental else [OutputAccumulator() for _ in range(num_outputs)]

    def view(self, i: int, ev: OutputEvent) -> dict:
        """The dict for event ``ev`` of output ``i`` (``index`` added when the call has several)."""
        out = ev.as_dict() if self.incremental else self._acc[i].add(ev)
        if self.num_outputs > 1:
            out["index"] = i
        return out


def sync_stream(q, batch, view: BatchView, loop):
    """Yield ``view.view(i, event)`` for each ``(i, event)`` put on ``q`` (a ``queue.Queue``) by the
    batch's sinks until every output of ``batch`` has finished.

    ``loop``: the engine's :class:`~sglite.runtime.engine_loop.EngineLoop`; when the consumer stops
    early (closes the generator) the batch's unfinished requests are aborted so their KV is freed.
    Raises RuntimeError when the loop thread has stopped with outputs still pending."""
    import queue as _queue

    finished = 0
    try:
        while finished < batch.num_outputs:
            try:
                i, ev = q.get(timeout=0.5)
            except _queue.Empty:
                if not loop.alive:
                    raise RuntimeError("engine loop has stopped") from None
                continue
            finished += ev.finished
            yield view.view(i, ev)
    finally:
        if finished < batch.num_outputs:  # the consumer stopped early: free the KV
            loop.abort_reqs(batch.all_reqs)
