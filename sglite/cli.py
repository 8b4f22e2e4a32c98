"""`sglite` command line: serve | generate | run | bench | kv-estimate."""
from __future__ import annotations

import argparse
import json
import runpy
import sys


def _cmd_kv_estimate(args) -> int:
    from .kv_estimate import estimate, format_estimate, load_config

    cfg = load_config(args.model_path, args.config)
    print(format_estimate(estimate(cfg, args.seq_len, args.batch, args.dtype)))
    return 0


def _cmd_generate(args) -> int:
    from .logging_setup import configure
    from .runtime.engine import Engine

    configure(args.log_level)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.regex:
        params["regex"] = args.regex
    if args.json_schema:
        params["json_schema"] = args.json_schema
    with Engine(model_path=args.model_path, dtype=args.dtype, log_level=args.log_level) as e:
        prompt = args.prompt
        if args.chat:
            prompt = e.apply_chat_template([{"role": "user", "content": prompt}])
        out = e.generate(prompt, params)
    print(json.dumps(out, indent=2) if args.json else out["text"])
    return 0


def _cmd_serve(argv) -> int:
    from .server.launch import main as serve_main

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
}


def _cmd_bench(argv) -> int:
    import importlib

    if not argv or argv[0] not in BENCHES:
        print(f"usage: sglite bench {{{'|'.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    mod = importlib.import_module(BENCHES[argv[0]])
    return mod.main(argv[1:]) or 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _cmd_serve(argv[1:])
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    p = argparse.ArgumentParser(prog="sglite", description="sglite: structured generation runtime")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="start the HTTP server (see `sglite serve --help`)")
    sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)}")
    k = sub.add_parser("kv-estimate", help="KV-cache bytes per token and totals")
    k.add_argument("--model-path", help="HF folder or .gguf file (default: the default model)")
    k.add_argument("--config", help="a HF config.json instead of a model")
    k.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    k.add_argument("--batch", type=int, default=16, help="sequences (default 16)")
    k.add_argument("--dtype", default="float16", help="KV dtype: float32|float16|bfloat16|fp8 (default float16)")
    g = sub.add_parser("generate", help="one generation on a model")
    g.add_argument("prompt", help="raw prompt text (completion mode unless --chat)")
    g.add_argument("--model-path", help="HF folder or .gguf file (default: the default model)")
    g.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default auto)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    g.add_argument("--regex", help="constrain the output to this regex")
    g.add_argument("--json-schema", help="constrain the output to this JSON Schema (JSON text)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print the whole output dict")
    g.add_argument("--log-level", default="info", help="debug|info|warning|error|critical (default info)")
    r = sub.add_parser("run", help="run a Python program (e.g. an @function script)")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        return {"kv-estimate": _cmd_kv_estimate, "generate": _cmd_generate, "run": _cmd_run}[args.cmd](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
