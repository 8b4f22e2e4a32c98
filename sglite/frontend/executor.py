"""StreamExecutor: runs one program stream's ops against a backend, in a worker thread.

``s += expr`` only queues ops; the worker executes them in order, so the program body keeps
running until it reads a value (``s[name]``, ``s.text()``), and fork branches, each with its
own executor, run concurrently (SGLang's interpreter model, ``StreamExecutor``). An exception
in the worker is kept (``error()``); later ops of that stream are skipped.

A program's main stream starts *deferred* (``defer=True``): its ops are held, and their role
blocks checked as they are appended, until the body first needs a value (``sync``: a read, a
fork, the end of the body). So nested or unmatched roles raise from the offending ``s += …`` in
the body, and a body that fails before its first read has sent nothing, without tracing the body
first (the program body runs exactly once per run).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

from sglite.errors import InvalidRequestError

from .chat_template import ChatContext, TextAssembler, role_transition
from .ir import (LOGPROB_KEYS, SAMPLING_KEYS, Argument, Gen, RoleBegin, RoleEnd, Select, Text,
                 VarRef, VarScopeBegin, VarScopeEnd, flatten)

logger = logging.getLogger(__name__)
_STOP = object()


class StreamExecutor:
    """Executes ops for one stream. Thread-safe: ``submit`` from the program body, reads from anywhere.

    Args:
        backend: a :class:`~sglite.frontend.backend.Backend`.
        defaults: run-level defaults (SGLang names: ``max_new_tokens``, ``temperature``, …, and
            the logprob keys); a gen's unset arguments take these values.
        stream: generate with ``backend.generate_stream`` and record text deltas for ``text_iter``.
        assembler: the text/messages to start from (copied), e.g. the parent's at a fork.
        defer: hold submitted ops (checking their roles) until the first ``sync``.
    """

    def __init__(self, backend, defaults: dict, stream: bool = False, assembler: Optional[TextAssembler] = None,
                 variables: Optional[dict] = None, meta_info: Optional[dict] = None, defer: bool = False):
        self.backend = backend
        self.defaults = dict(defaults)
        self.stream = stream
        self.cond = threading.Condition()
        self.chunks: list = []          # every text delta, in order (stream mode)
        self.var_chunks: dict = {}      # variable -> its deltas (stream mode)
        self.var_done: set = set()
        self.finished = False
        if assembler is None:
            self.asm = TextAssembler(backend.get_chat_template(), self._on_append)
        else:
            self.asm = assembler.copy(self._on_append)
        self.variables = dict(variables or {})
        self.meta_info = dict(meta_info or {})
        self.fork_start = len(self.asm.text)
        self.children: list = []
        self._scopes: dict = {}
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._queue: Optional[queue.Queue] = None
        self._closed_queue: Optional[queue.Queue] = None  # the queue a close() stopped, still draining
        self._deferred: Optional[list] = [] if defer else None
        self._deferred_role = self.asm.cur_role  # the role open after the deferred ops
        self._spec = ""  # API speculative execution: generated text not yet used (see _spec_gen)
        #: set once held ops may reach the backend (the first ``sync``); ``sent`` tells the same
        self.released = threading.Event()
        self.sent = not defer
        if not defer:
            self.released.set()

    # ------------------------------------------------------------------ queue and worker
    def submit(self, expr) -> None:
        """Queue the ops of ``expr`` (str/Expr) for execution; returns at once.

        Raises:
            InvalidRequestError: while deferred, a role block of ``expr`` nests or mismatches
                (nothing of ``expr`` is queued then).
        """
        ops = flatten(expr)
        with self._lock:
            if self._deferred is not None:
                role = self._deferred_role
                for op in ops:
                    if isinstance(op, (RoleBegin, RoleEnd)):
                        role = role_transition(role, op.role, isinstance(op, RoleBegin))
                self._deferred_role = role
                self._deferred.extend(ops)
                return
            self._put(ops)

    def _put(self, ops: list) -> None:
        """Hand ``ops`` to the worker (starting it). Caller holds ``_lock``."""
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._loop, args=(self._queue,), daemon=True,
                             name="sglite-program").start()
        for op in ops:
            self._queue.put(op)

    def release(self) -> None:
        """End the deferral: queue the held ops; later ops are queued as they come."""
        with self._lock:
            held, self._deferred = self._deferred, None
            if held:
                self._put(held)
            self.sent = True
        self.released.set()

    def sync(self) -> None:
        """Release held ops, then block until every queued op has run (including ops queued
        before a ``close()``: a closed stream's worker finishes them before it stops)."""
        self.release()
        with self._lock:
            queues = [q for q in (self._closed_queue, self._queue) if q is not None]
        for q in queues:
            q.join()

    def close(self) -> None:
        """Stop the worker thread (a later ``submit`` starts a new one); closes fork children too.

        Ops still held (the body failed before its first read) are dropped: they never run.
        """
        with self._lock:
            self._deferred = None
            if self._queue is not None:
                self._queue.put(_STOP)
                self._closed_queue, self._queue = self._queue, None
        for c in self.children:
            c.close()

    def mark_finished(self) -> None:
        """Tell streaming readers that no more text will come."""
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def error(self) -> Optional[BaseException]:
        """The exception an op raised, or None."""
        return self._error

    def set_error(self, exc: BaseException) -> None:
        """Record ``exc`` (first one wins) and wake every waiter."""
        with self.cond:
            if self._error is None:
                self._error = exc
            self.cond.notify_all()

    def _loop(self, q: queue.Queue) -> None:
        while True:
            op = q.get()
            try:
                if op is _STOP:
                    return
                if self._error is None:
                    self._execute(op)
            except Exception as e:  # kept for state.error(), as SGLang does
                logger.warning("sglite program op %s failed: %r", type(op).__name__, e)
                self.set_error(e)
            finally:
                q.task_done()

    # ------------------------------------------------------------------ text and variables
    def _on_append(self, delta: str) -> None:
        if self.stream:
            with self.cond:
                self.chunks.append(delta)
                self.cond.notify_all()

    def set_var(self, name: str, value, meta=None, streamed: bool = False) -> None:
        """Set variable ``name`` (and its meta info) and wake readers."""
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            if self.stream and not streamed:
                self.var_chunks.setdefault(name, []).append(value if isinstance(value, str) else str(value))
            self.var_done.add(name)
            self.cond.notify_all()

    # ------------------------------------------------------------------ ops
    def _execute(self, op) -> None:
        if isinstance(op, Text):
            # speculated text stays usable while the program writes exactly what was speculated
            self._spec = self._spec[len(op.value):] if self._spec.startswith(op.value) else ""
            self.asm.append(op.value)
            return
        if not isinstance(op, Gen):
            self._spec = ""
        if isinstance(op, RoleBegin):
            self.asm.role_begin(op.role)
        elif isinstance(op, RoleEnd):
            self.asm.role_end(op.role)
        elif isinstance(op, Gen):
            self._gen(op)
        elif isinstance(op, Select):
            lora = op.lora_path or self.defaults.get("lora_path")
            decision = self.backend.select(self.asm.text, list(op.choices), op.choices_method, **self._chat(),
                                           **({"lora_path": lora} if lora else {}))
            self.asm.append(decision.decision)
            if op.name:
                self.set_var(op.name, decision.decision, decision.meta_info)
        elif isinstance(op, VarScopeBegin):
            self._scopes[op.name] = len(self.asm.text)
        elif isinstance(op, VarScopeEnd):
            start = self._scopes.pop(op.name, None)
            if start is None:
                raise InvalidRequestError(f"var_scope {op.name!r} ended without a begin", field="var_scope")
            self.set_var(op.name, self.asm.text[start:])
        elif isinstance(op, (Argument, VarRef)):
            raise InvalidRequestError(f"{op!r} is a tracing placeholder and cannot run", field="expr")
        else:
            raise InvalidRequestError(f"unknown op {type(op).__name__}", field="expr")

    def sampling_params(self, op: Gen) -> tuple:
        """``(sampling_params, logprob_kwargs)`` of a gen: run defaults overridden by its set
        arguments; inside a role the template's end-of-turn string is added to ``stop``."""
        sp = {k: self.defaults[k] for k in SAMPLING_KEYS if self.defaults.get(k) is not None}
        sp.update(op.params)
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        eot = self.asm.template.end_of_turn
        if self.asm.cur_role is not None and eot and eot not in stop:
            stop.append(eot)
        if stop:
            sp["stop"] = stop
        else:
            sp.pop("stop", None)
        lp = {k: self.defaults.get(k) for k in LOGPROB_KEYS}
        lp.update(op.logprob)
        return sp, {k: v for k, v in lp.items() if v is not None}

    def _chat(self) -> dict:
        """``{"chat": ChatContext}`` for backends that talk in messages (``wants_messages``), else {}."""
        if not getattr(self.backend, "wants_messages", False):
            return {}
        role, partial = self.asm.open_turn()
        return {"chat": ChatContext([dict(m) for m in self.asm.messages], role, partial)}

    def _speculates(self, sp: dict) -> bool:
        return bool(self.defaults.get("num_api_spec_tokens") and getattr(self.backend, "supports_api_speculation", False)
                    and not self.stream and self.asm.cur_role is None and sp.get("n", 1) == 1
                    and not any(sp.get(k) for k in ("regex", "json_schema", "ebnf", "stop_regex")))

    def _spec_gen(self, prompt: str, sp: dict, lp: dict) -> tuple:
        """SGLang's API speculative execution (interpreter ``_spec_gen``): ``(value, meta)`` of a
        plain gen, cut from text generated ahead. Lengths of speculated text are counted in
        characters against ``max_new_tokens``, as SGLang does."""
        max_new = sp.get("max_new_tokens", 128)
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        meta: dict = {}
        if (not stop and len(self._spec) < max_new) or (stop and not self._spec):
            ahead = {k: v for k, v in sp.items() if k != "stop"}
            ahead["max_new_tokens"] = max(max_new, self.defaults["num_api_spec_tokens"])
            out = self.backend.generate(prompt, ahead, **lp)
            self._spec, meta = out["text"], out["meta_info"]
        if stop:
            hits = [i for i in (self._spec.find(s) for s in stop if s) if i >= 0]
            cut = min(hits) if hits else min(max_new, len(self._spec))
        else:
            cut = max_new
        value, self._spec = self._spec[:cut], self._spec[cut:]
        return value, meta

    def _gen(self, op: Gen) -> None:
        sp, lp = self.sampling_params(op)
        lp.update(self._chat())
        prompt = self.asm.text
        if self._speculates(sp):
            value, meta = self._spec_gen(prompt, sp, lp)
            self.asm.append(value)
            if op.name:
                self.set_var(op.name, value, meta)
            return
        self._spec = ""
        if self.stream and sp.get("n", 1) == 1:
            emitted, meta = "", {}
            for out in self.backend.generate_stream(prompt, sp, **lp):
                text = out.get("text") or ""
                delta = text[len(emitted):] if text.startswith(emitted) else ""
                if delta:
                    emitted += delta
                    self.asm.append(delta)
                    if op.name:
                        with self.cond:
                            self.var_chunks.setdefault(op.name, []).append(delta)
                            self.cond.notify_all()
                meta = out.get("meta_info") or meta
            if op.name:
                self.set_var(op.name, emitted, meta, streamed=True)
            return
        out = self.backend.generate(prompt, sp, **lp)
        if isinstance(out, list):  # n > 1: the first completion continues the text (SGLang)
            value, meta = [o["text"] for o in out], [o["meta_info"] for o in out]
            self.asm.append(value[0])
        else:
            value, meta = out["text"], out["meta_info"]
            self.asm.append(value)
        if op.name:
            self.set_var(op.name, value, meta)

    # ------------------------------------------------------------------ fork
    def fork_child(self) -> "StreamExecutor":
        """A new executor starting from this one's current text, messages and variables.

        The caller must have synced this executor first.
        """
        child = StreamExecutor(self.backend, dict(self.defaults, num_api_spec_tokens=None), False, self.asm,
                               self.variables, self.meta_info)
        child._error = self._error
        self.children.append(child)
        return child
