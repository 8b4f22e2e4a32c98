"""``--log-requests``: one info line when a request arrives and one per output when it finishes.

    Receive: rid=4f2c…, prompts=1, prompt='Hello, my name is', sampling_params={'max_new_tokens': 8}
    Finish: rid=4f2c…, prompt_tokens=5, cached_tokens=0, completion_tokens=8, finish_reason=length,
        e2e_latency=0.412 s, text=' John. I am a'

The fields are those of SGLang's request log (rid, prompt, sampling params; finish reason,
token counts, latency, output text); texts are cut to ``max_chars`` characters (``…`` marks a cut).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("sglite.server.requests")


def shorten(text: Any, max_chars: int) -> str:
    """``repr`` of ``text`` cut to ``max_chars`` characters of content (``…`` appended when cut)."""
    s = str(text)
    return repr(s) if len(s) <= max_chars else repr(s[:max_chars]) + "…"


class RequestLog:
    """Writes the request summaries of one server (no shared state).

    Args:
        max_chars: texts (prompt, output) are cut to this many characters.
    """

    def __init__(self, max_chars: int = 200):
        self.max_chars = max_chars

    def received(self, call) -> None:
        """Log a :class:`~sglite.server.engine_client.GenCall` as it is handed to the engine."""
        if not log.isEnabledFor(logging.INFO):
            return
        if call.prompts is not None:
            n, what = len(call.prompts), f"prompt={shorten(call.prompts[0], self.max_chars)}"
        else:
            n = len(call.input_ids or [])
            what = f"input_ids=[{len(call.input_ids[0]) if call.input_ids else 0} ids]"
        sp = call.sampling_params[0] if call.sampling_params else {}
        sp = {k: (shorten(v, self.max_chars) if isinstance(v, str) else v) for k, v in sp.items() if v is not None}
        log.info("Receive: rid=%s, prompts=%d, %s, sampling_params=%s, return_logprob=%s", call.rid, n, what, sp,
                 call.logprobs.return_logprob)

    def finished(self, out: dict, text_complete: bool = True) -> None:
        """Log one finished engine output dict (``text`` and ``meta_info``). ``text_complete``
        False (an incremental stream's last delta): the text is not logged."""
        if not log.isEnabledFor(logging.INFO):
            return
        m = out.get("meta_info", {})
        fr = m.get("finish_reason") or {}
        reason = fr.get("type") if isinstance(fr, dict) else fr
        lat = m.get("e2e_latency")
        text = shorten(out.get("text", ""), self.max_chars) if text_complete else "(streamed)"
        log.info("Finish: rid=%s, prompt_tokens=%s, cached_tokens=%s, completion_tokens=%s, finish_reason=%s, "
                 "e2e_latency=%s, text=%s", m.get("id"), m.get("prompt_tokens"), m.get("cached_tokens"),
                 m.get("completion_tokens"), reason, f"{lat:.3f} s" if isinstance(lat, (int, float)) else lat, text)
