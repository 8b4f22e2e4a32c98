"""`sglite` command line: serve | generate | run | bench | eval | quantize | kv-estimate."""
from __future__ import annotations

import argparse
import json
import runpy
import sys

from . import __version__
from .flags import FlagParser, add_engine_args


def _cmd_kv_estimate(args) -> int:
    from .kv_estimate import estimate, format_estimate, load_config

    cfg = load_config(args.model_path, args.config)
    print(format_estimate(estimate(cfg, args.seq_len, args.batch, args.dtype, args.kv_cache_dtype,
                                   args.kv_cache_quant_group_size)))
    return 0


def _generate_params(args) -> dict:
    """The sampling params of ``sglite generate``, validated (nothing is loaded).

    Raises:
        InvalidRequestError: naming the field (``max_new_tokens``, ``regex``, ``json_schema`` ...).
    """
    from .errors import GrammarError, InvalidRequestError
    from .sampling_params import SamplingParams

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.regex:
        from .constrained.regex_parse import parse_regex
        try:
            parse_regex(args.regex)
        except GrammarError as exc:
            raise InvalidRequestError(f"regex: invalid regex: {exc}", field="regex") from exc
        params["regex"] = args.regex
    if args.json_schema:
        try:
            schema = json.loads(args.json_schema)
        except ValueError as exc:
            raise InvalidRequestError(f"json_schema: not JSON text: {exc}", field="json_schema") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema: must be a JSON object", field="json_schema")
        params["json_schema"] = args.json_schema
    SamplingParams.from_dict(dict(params))
    return params


def _cmd_generate(args, parser) -> int:
    from .flags import engine_kwargs, fail
    from .runtime.engine_config import engine_config

    kwargs = engine_kwargs(args)
    # one request: a pool for one full context, not the server's 64 (unless the flags say otherwise)
    kwargs.setdefault("max_running_requests", 1)
    try:  # every flag and the request are checked before the model is loaded
        engine_config(**kwargs)
        params = _generate_params(args)
    except ValueError as exc:
        fail(parser, exc)
    from .logging_setup import configure
    from .runtime.engine import Engine

    configure(kwargs.get("log_level", "info"))
    try:
        e = Engine(**kwargs)
    except ValueError as exc:
        fail(parser, exc)
    with e:
        prompt = args.prompt
        if args.chat:
            prompt = e.apply_chat_template([{"role": "user", "content": prompt}])
        out = e.generate(prompt, params)
    print(json.dumps(out, indent=2) if args.json else out["text"])
    return 0


def _cmd_serve(argv) -> int:
    from .launch_server import main as serve_main

    serve_main(argv)
    return 0


def _cmd_run(args) -> int:
    sys.argv = [args.script] + args.script_args
    runpy.run_path(args.script, run_name="__main__")
    return 0


BENCHES = {
    "offline": "sglite.bench.offline",
    "serving": "sglite.bench.serving",
    "sweep": "sglite.bench.sweep",
    "grammar": "sglite.bench.grammar",
    "startup": "sglite.bench.startup",
    "router": "sglite.bench.router",
    "spec": "sglite.bench.spec",
    "quant": "sglite.bench.quant",
    "agent": "sglite.bench.agent",
    "regress": "sglite.bench.regress",
}


# One line each for `sglite bench --help` / `sglite eval --help` (kept here, not read from the
# modules' docstrings, so that --help imports nothing heavy).
BENCH_DESCRIPTIONS = {
    "offline": "the in-process Engine against baselines measured in the same run",
    "serving": "load-test a running server (or one it launches) and time every token",
    "sweep": "one workload at several request rates against server configurations in turn",
    "grammar": "compile and per-token mask time of the grammar backend (xgrammar / llguidance beside it)",
    "startup": "how long a fresh process takes to import sglite, build an Engine and generate",
    "router": "prefix-cache hit rate of data-parallel routing against one worker",
    "spec": "decode speed with and without speculative decoding, side by side",
    "quant": "native quantized weights against the dequantized path, side by side",
    "agent": "multi-turn tool-calling conversations over /v1/responses",
    "regress": "the CI regression gate: instruction counts of a fixed workload under callgrind",
}

EVALS = {"perplexity": "sglite.eval.perplexity"}
EVAL_DESCRIPTIONS = {"perplexity": "perplexity of a model (any engine configuration) over a fixed local text"}


def _dispatch(group: str, modules: dict, descriptions: dict, argv) -> int:
    """Run ``sglite GROUP NAME [options]``: NAME's module's ``main``. ``--help``/``-h`` lists the
    sub-commands on stdout (exit 0); no name or an unknown one lists them on stderr (exit 2)."""
    import importlib

    usage = f"usage: sglite {group} {{{'|'.join(modules)}}} [options]  (see `sglite {group} NAME --help`)"
    listing = "\n".join([usage, "", "commands:"] + [f"  {n:<12}{descriptions.get(n, '')}" for n in modules])
    if argv and argv[0] in ("-h", "--help"):
        print(listing)
        return 0
    if not argv or argv[0] not in modules:
        problem = f"unknown {group} command {argv[0]!r}" if argv else f"a {group} command is required"
        print(f"sglite {group}: {problem}\n{listing}", file=sys.stderr)
        return 2
    return importlib.import_module(modules[argv[0]]).main(argv[1:]) or 0


def _cmd_eval(argv) -> int:
    return _dispatch("eval", EVALS, EVAL_DESCRIPTIONS, argv)


def _cmd_bench(argv) -> int:
    return _dispatch("bench", BENCHES, BENCH_DESCRIPTIONS, argv)


def build_parser() -> tuple[FlagParser, FlagParser]:
    """The ``sglite`` parser and its ``generate`` sub-parser (``serve`` and ``bench`` parse their
    own flags: :func:`sglite.launch_server.build_parser`, the bench modules)."""
    p = FlagParser(prog="sglite", description="sglite: structured generation runtime")
    p.add_argument("--version", action="version", version=f"sglite {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=FlagParser, prog="sglite")
    sub.add_parser("serve", help="start the HTTP server (see `sglite serve --help`)")
    sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)}")
    sub.add_parser("router", help="data-parallel router over sglite servers (see `sglite router --help`)")
    sub.add_parser("train-draft", help="train EAGLE / Medusa draft heads (see `sglite train-draft --help`)")
    sub.add_parser("quantize", help="write a GPTQ / AWQ / RTN / W8A8 checkpoint (see `sglite quantize --help`)")
    sub.add_parser("eval", help=f"model evaluation: {' | '.join(EVALS)} (see `sglite eval perplexity --help`)")
    k = sub.add_parser("kv-estimate", help="KV-cache bytes per token and totals")
    k.add_argument("--model-path", help="HF folder or .gguf file (default: the default model)")
    k.add_argument("--config", help="a HF config.json instead of a model (default: None)")
    k.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    k.add_argument("--batch", type=int, default=16, help="sequences (default: 16)")
    k.add_argument("--dtype", default="float16", help="model dtype: float32|float16|bfloat16|fp8 (default: float16)")
    k.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3", "int8", "int4"),
                   help="KV pool storage; auto = --dtype (default: auto)")
    k.add_argument("--kv-cache-quant-group-size", type=int, default=128,
                   help="tokens per int8/int4 key group (default: 128)")
    g = sub.add_parser("generate", help="one generation on a model", usage="%(prog)s PROMPT [options]  (all flags: --help)",
                       description="One generation on a model; "
                       "every flag is checked before the model is loaded.")
    g.add_argument("prompt", help="raw prompt text (completion mode unless --chat)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    g.add_argument("--regex", default=None, help="constrain the output to this regex (default: None)")
    g.add_argument("--json-schema", default=None,
                   help="constrain the output to this JSON Schema, JSON text (default: None)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (default: off)")
    g.add_argument("--json", action="store_true", help="print the whole output dict (default: off)")
    add_engine_args(g)
    r = sub.add_parser("run", help="run a Python program (e.g. an @function script)",
                       usage="%(prog)s SCRIPT [args ...]")
    r.add_argument("script", help="path of the Python file")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.usage = f"%(prog)s {{{','.join(sub.choices)}}} ...  (see --help)"  # every sub-command, as added
    return p, g


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _cmd_serve(argv[1:])
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    if argv and argv[0] == "router":
        from .router.cli import main as router_main
        return router_main(argv[1:])
    if argv and argv[0] == "eval":
        return _cmd_eval(argv[1:])
    if argv and argv[0] == "train-draft":
        from .train_draft import main as train_draft_main

        return train_draft_main(argv[1:]) or 0
    if argv and argv[0] == "quantize":
        from .quantize import main as quantize_main

        return quantize_main(argv[1:]) or 0
    p, g = build_parser()
    args = p.parse_args(argv)
    if args.cmd == "generate":
        return _cmd_generate(args, g)
    try:
        return {"kv-estimate": _cmd_kv_estimate, "run": _cmd_run}[args.cmd](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
