"""``Runtime``: an sglite server in a child process, usable as a frontend backend (SGLang's ``sgl.Runtime``).

    runtime = sglite.Runtime(model_path="SmolLM2-135M-Instruct", disable_radix_cache=True)
    sglite.set_default_backend(runtime)        # programs now talk to it over HTTP
    print(runtime.url, runtime.generate("Hi", {"max_new_tokens": 8}))
    runtime.shutdown()

Keyword arguments are the flags of ``sglite serve`` with underscores (``chunked_prefill_size=256``
is ``--chunked-prefill-size 256``; ``disable_radix_cache=True`` is ``--disable-radix-cache``; a
default-on feature is turned off with ``enable_x=False``). They are checked here, before the child
starts: an unknown or bad one raises ``InvalidRequestError`` naming it. No torch is imported in
the calling process.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
from typing import Optional

from sglite.errors import InvalidRequestError

from .runtime_endpoint import RuntimeEndpoint

#: Runtime arguments that are not server flags (SGLang's names)
_OWN = ("log_level", "launch_timeout", "port", "api_key")


def server_argv(model_path: Optional[str], server_args: dict) -> list:
    """``sglite serve`` arguments for ``model_path`` and ``server_args`` (python names → flags).

    Raises:
        InvalidRequestError: an unknown argument, or a value the flag refuses (the message is
            the flag parser's, naming the flag).
    """
    from sglite.launch_server import build_parser

    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    argv = [] if model_path is None else ["--model-path", str(model_path)]
    for name, value in server_args.items():
        # a config field's dest, or a flag's spelling (``tp_size`` → ``--tp-size``: known, refused
        # unless its no-op value)
        action = by_dest.get(name) or by_flag.get("--" + name.replace("_", "-"))
        if action is None or name in ("host", "port", "help", "version"):
            raise InvalidRequestError(f"Runtime: unknown server argument {name!r} (the flags of `sglite serve`, "
                                      f"with underscores)", field=name)
        flag = action.option_strings[0] if action.dest == name else "--" + name.replace("_", "-")
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, argparse._StoreConstAction) and action.const is False:  # --disable-x
            argv += [] if value else [flag]
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise InvalidRequestError(f"Runtime: {msg[-1] if msg else 'bad server arguments'}",
                                  field="server_args") from None
    return argv


class Runtime:
    """A ``sglite serve`` child process on 127.0.0.1 and its HTTP backend.

    Args:
        model_path: the model (``--model-path``); None takes the server's default model.
        log_level: the child's ``--log-level`` (SGLang's default "error").
        launch_timeout: seconds to wait for the server to answer ``/health`` (default 300).
        port: a port to use (default: a free one).
        api_key: the server's ``--api-key``; the endpoint sends it.
        **server_args: any other ``sglite serve`` flag (see the module docstring).

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        endpoint: a :class:`~sglite.frontend.runtime_endpoint.RuntimeEndpoint` on it; passing the
            Runtime itself where a backend is expected (``set_default_backend(runtime)``,
            ``run(backend=runtime)``) uses this endpoint.

    Raises:
        InvalidRequestError: a bad argument (before anything starts).
        RuntimeError: the server exited or was not healthy within ``launch_timeout`` (the end of
            its log is in the message).
    """

    def __init__(self, model_path: Optional[str] = None, log_level: str = "error", launch_timeout: float = 300.0,
                 port: Optional[int] = None, api_key: Optional[str] = None, **server_args):
        from sglite.server.launcher import LaunchedServer  # no torch: the server runs in the child

        args = dict(server_args, log_level=log_level)
        if api_key is not None:
            args["api_key"] = api_key
        argv = server_argv(model_path, args)
        self.server_args = dict(server_args, model_path=model_path)
        self._server = LaunchedServer(argv, mode="subprocess", startup_timeout=launch_timeout, port=port)
        self._server.__enter__()
        self.url = self._server.url
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the child server (SIGTERM, then SIGKILL after 20 s); idempotent."""
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            self.endpoint.close()
            server.stop()
            atexit.unregister(self.shutdown)

    @property
    def alive(self) -> bool:
        """Whether the child server is running."""
        s = self._server
        return s is not None and s._proc is not None and s._proc.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The end of the child's log ('' after shutdown)."""
        return self._server.log_tail(n_bytes) if self._server is not None else ""

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ SGLang's helpers
    def generate(self, prompt, sampling_params: Optional[dict] = None, return_logprob: bool = False,
                 logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None) -> str:
        """``POST /generate`` for ``prompt`` (str or list); the response as JSON **text**, as
        SGLang's ``Runtime.generate`` returns it."""
        payload = {"text": prompt, "sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob}
        if logprob_start_len is not None:
            payload["logprob_start_len"] = logprob_start_len
        if top_logprobs_num is not None:
            payload["top_logprobs_num"] = top_logprobs_num
        return json.dumps(self.endpoint._post("/generate", payload))

    def cache_prefix(self, prefix: str) -> dict:
        """Prefill ``prefix`` into the server's prefix cache; its meta_info."""
        return self.endpoint.cache_prefix(prefix)

    def flush_cache(self) -> bool:
        """Flush the server's prefix cache (False when requests are running)."""
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict:
        """``GET /get_server_info``."""
        return self.endpoint.get_server_info()

    def get_model_info(self) -> dict:
        """``GET /get_model_info``."""
        return self.endpoint.get_model_info()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (loaded here, from the server's model path)."""
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.get_model_info()["model_path"])

    def __repr__(self):
        return f"Runtime({self.url!r})"
