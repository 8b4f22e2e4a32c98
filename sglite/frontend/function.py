"""``@function``: a program (SGLang's ``SglFunction``) with ``run``, ``run_batch``, ``trace``, ``bind``.

``run`` runs the body once: its ops are held until its first value read, so nested roles and bad
expressions raise before any request (see :mod:`.interpreter`). Only ``run_batch`` traces first
(a *prefix trace* up to each program's first value read, see :mod:`.tracer`): it needs every
item checked before any item sends, and the constant prefix it hoists (prefilled once for the
whole batch).
"""
from __future__ import annotations

import concurrent.futures as cf
import inspect
import logging
import os
import re
from typing import Optional

import networkx as nx

from sglite.errors import InvalidRequestError, SgliteError
from sglite.sampling_params import SamplingParams

from .api import resolve_backend
from .global_config import global_config
from .compiler import check_roles, constant_prefix, hoist_prefix
from .interpreter import run_program
from .ir import Argument
from .tracer import trace_program

logger = logging.getLogger(__name__)

#: run-level defaults (SGLang's ``SglFunction.run``); a gen's unset arguments take these
RUN_DEFAULTS = {"max_new_tokens": 128, "n": None, "stop": None, "stop_token_ids": None, "stop_regex": None,
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "ignore_eos": False, "return_logprob": None, "logprob_start_len": None,
                "top_logprobs_num": None, "return_text_in_logprobs": None, "lora_path": None}


def _run_defaults(options: dict) -> dict:
    """Merge ``options`` into RUN_DEFAULTS and validate the sampling ones.

    Raises:
        InvalidRequestError: an unknown option or a bad value, naming it.
    """
    unknown = sorted(set(options) - set(RUN_DEFAULTS))
    if unknown:
        raise InvalidRequestError(f"unknown run option(s) {unknown}; known: {sorted(RUN_DEFAULTS)}",
                                  field=unknown[0])
    d = {**RUN_DEFAULTS, **options}
    sp = {k: v for k, v in d.items() if v is not None and k in SamplingParams.__dataclass_fields__}
    SamplingParams(**sp).validate()
    return d


class Function:
    """A DSL program: ``func(s, *args)``; the first parameter must be named ``s``.

    Calling it (``fn(**kw)``) is ``fn.run(**kw)``.

    Raises:
        InvalidRequestError: the function's first parameter is not ``s``.
    """

    def __init__(self, func, bound: Optional[dict] = None, num_api_spec_tokens: Optional[int] = None):
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise InvalidRequestError(f"@function {getattr(func, '__name__', func)!r}: the first parameter "
                                      f"must be named 's'", field="function")
        self.func = func
        self._params = [p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self._names = [p.name for p in self._params]
        self.bound = dict(bound or {})
        if num_api_spec_tokens is not None and (isinstance(num_api_spec_tokens, bool)
                                                or not isinstance(num_api_spec_tokens, int) or num_api_spec_tokens < 1):
            raise InvalidRequestError(f"@function: num_api_spec_tokens must be an integer >= 1, got "
                                      f"{num_api_spec_tokens!r}", field="num_api_spec_tokens")
        self.num_api_spec_tokens = num_api_spec_tokens
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)

    # ------------------------------------------------------------------ arguments
    def bind(self, **kwargs) -> "Function":
        """A new Function with some arguments fixed.

        Raises:
            InvalidRequestError: a name that is not an argument.
        """
        for k in kwargs:
            if k not in self._names:
                raise InvalidRequestError(f"{self.__name__}.bind: unknown argument {k!r}; arguments: {self._names}",
                                          field=k)
        return Function(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    def bind_arguments(self, args: tuple = (), kwargs: Optional[dict] = None) -> dict:
        """Map positional and keyword arguments onto the program's parameters (defaults filled).

        Raises:
            InvalidRequestError: "arguments mismatch" (too many / missing / unknown / duplicate).
        """
        kwargs = kwargs or {}
        free = [p for p in self._params if p.name not in self.bound and p.kind == p.POSITIONAL_OR_KEYWORD]
        n_req = sum(1 for p in free if p.default is p.empty)
        if len(args) > len(free):
            raise InvalidRequestError(f"{self.__name__}: arguments mismatch: got {len(args)} positional, "
                                      f"expected {n_req} to {len(free)}", field="arguments")
        values = dict(self.bound)
        values.update((p.name, v) for p, v in zip(free, args))
        for k, v in kwargs.items():
            if k not in self._names:
                raise InvalidRequestError(f"{self.__name__}: arguments mismatch: unknown argument {k!r}; "
                                          f"arguments: {self._names}", field=k)
            if k in values and k not in self.bound:
                raise InvalidRequestError(f"{self.__name__}: argument {k!r} given twice", field=k)
            values[k] = v
        missing = [p.name for p in self._params if p.name not in values and p.default is p.empty]
        if missing:
            raise InvalidRequestError(f"{self.__name__}: arguments mismatch: missing {missing}", field=missing[0])
        for p in self._params:
            values.setdefault(p.name, p.default)
        return values

    def _bind_item(self, item) -> dict:
        if isinstance(item, dict):
            return self.bind_arguments((), item)
        if isinstance(item, (tuple, list)):
            return self.bind_arguments(tuple(item), {})
        raise InvalidRequestError(f"{self.__name__}.run_batch: each item must be a dict or a tuple/list of "
                                  f"positional arguments, got {type(item).__name__}", field="batch_kwargs")

    # ------------------------------------------------------------------ compile-time checks
    def prefix_trace(self, arguments: dict) -> Optional[nx.DiGraph]:
        """Trace the program up to its first value read and check it (no request is sent).

        Returns the graph, or None when the body cannot be traced (it raised on placeholder values).

        Raises:
            SgliteError (InvalidRequestError/GrammarError): nested roles, bad gen/select arguments.
        """
        try:
            graph = trace_program(self.func, arguments, strict=True)
        except (SgliteError, re.error):
            raise
        except Exception as e:  # the body needs real values; checks happen at run time instead
            logger.debug("prefix trace of %s stopped: %r", self.__name__, e)
            return None
        check_roles(graph)
        return graph

    # ------------------------------------------------------------------ running
    def run(self, *args, stream: bool = False, backend=None, **kwargs):
        """Run once; returns a :class:`~sglite.frontend.state.ProgramState`.

        Keyword arguments named in :data:`RUN_DEFAULTS` (``max_new_tokens``, ``temperature``, …)
        are run-level sampling defaults; the rest are program arguments.

        The body runs exactly once (no trace): its ops are held until it first reads a value.

        Raises:
            InvalidRequestError / GrammarError: bad arguments, nested roles, bad expressions
            appended before the body's first value read — before any request is sent.
        """
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_DEFAULTS}
        defaults = dict(_run_defaults(options), num_api_spec_tokens=self.num_api_spec_tokens)
        arguments = self.bind_arguments(args, kwargs)
        backend = resolve_backend(backend)
        state = run_program(self.func, arguments, backend, defaults, stream)
        if global_config.verbosity >= 2 and not stream:
            print(state.text())
        return state

    __call__ = run

    def run_batch(self, batch_kwargs, *, backend=None, num_threads="auto", progress_bar: bool = False,
                  generator_style: bool = False, **options):
        """Run once per item (dicts or positional tuples); states in input order.

        Every item's arguments are checked and every program prefix-traced before any request;
        the prefix the batch shares is prefilled once (unless
        ``global_config.enable_precache_with_tracing`` is off); programs run on ``num_threads``
        threads ("auto": max(96, 16 × CPUs), at most the batch size). ``progress_bar`` shows a
        tqdm bar. ``generator_style=True`` returns a generator instead of a list: it yields the
        states in input order, each as soon as it (and every earlier one) has finished, while
        the later ones keep running (SGLang's ``generator_style``).

        Raises:
            InvalidRequestError: arity errors, bad options, nested roles (nothing is sent then;
                with ``generator_style`` these are raised by this call, not by the generator).
        """
        defaults = dict(_run_defaults(options), num_api_spec_tokens=self.num_api_spec_tokens)
        items = [self._bind_item(x) for x in batch_kwargs]
        if not items:
            return []
        if num_threads == "auto":
            num_threads = max(96, 16 * (os.cpu_count() or 1))
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise InvalidRequestError(f"run_batch.num_threads: must be 'auto' or an integer >= 1, got "
                                      f"{num_threads!r}", field="num_threads")
        backend = resolve_backend(backend)
        graphs = [self.prefix_trace(a) for a in items]
        if global_config.enable_precache_with_tracing:
            template = backend.get_chat_template()
            hoist_prefix(backend, [constant_prefix(g, template) for g in graphs if g is not None])
        runs = self._run_items(items, backend, defaults, num_threads, progress_bar)
        return runs if generator_style else list(runs)

    def _run_items(self, items, backend, defaults, num_threads, progress_bar):
        """Generator of the items' states in input order (each yielded once finished)."""
        bar = None
        if progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc=self.__name__)
        pool = cf.ThreadPoolExecutor(min(num_threads, len(items)))
        try:
            futures = [pool.submit(run_program, self.func, a, backend, defaults, False) for a in items]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update(1))
            for f in futures:
                yield f.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if bar is not None:
                bar.close()

    def trace(self, *, backend=None, **kwargs) -> nx.DiGraph:
        """The program's request graph (see :mod:`.tracer`); missing arguments become placeholders.

        With a backend, ``graph.graph["constant_prefix"]`` is the prompt text every run starts with.
        """
        values = dict(self.bound)
        for p in self._params:
            if p.name in kwargs:
                values[p.name] = kwargs[p.name]
            elif p.name not in values:
                values[p.name] = Argument(p.name)
        graph = trace_program(self.func, values, strict=False)
        graph.graph["function"] = self.__name__
        if backend is not None:
            graph.graph["constant_prefix"] = constant_prefix(graph, resolve_backend(backend).get_chat_template())
        return graph

    def __repr__(self):
        return f"<sglite function {self.__name__}({', '.join(self._names)})>"


def function(func=None, *, num_api_spec_tokens: Optional[int] = None):
    """Decorator making ``func(s, ...)`` a :class:`Function` (``@function`` or ``@function()``).

    ``num_api_spec_tokens=N`` turns on SGLang's API speculative execution for backends that bill
    per request (``sglite.OpenAI`` on ``/completions``): a plain ``gen`` outside a chat turn asks
    for ``max(max_tokens, N)`` tokens with no stop, takes its value up to its own stop, and keeps
    the rest; later constant text that matches the kept text, and later plain gens, are served
    from it without a request (see :mod:`.executor`). Other backends ignore it.

    Raises:
        InvalidRequestError: ``num_api_spec_tokens`` is not an integer >= 1.
    """
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)
