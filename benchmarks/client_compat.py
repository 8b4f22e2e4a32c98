"""Third-party OpenAI clients against ``sglite serve``: pass/fail per case, and what each client sent.

    python3 -m venv .venv-clients
    .venv-clients/bin/pip install openai instructor langchain-openai litellm dspy outlines guidance httpx
    .venv-clients/bin/python benchmarks/client_compat.py [--server-python .venv/bin/python] [--model-path P]
                                                         [--url http://127.0.0.1:30000] [--only instructor]

The clients live in their own virtual environment (they pin versions of ``openai`` and friends
that the project's dev environment does not need); this script does not import sglite. It
starts ``sglite serve`` on the default model with the project's interpreter (``--server-python``,
default ``.venv/bin/python``), unless ``--url`` names a running server, and puts a recording
proxy in front of it, so the report lists, per case, the request fields each client sent
(``response_format`` types, ``tools``/``tool_choice``, ``strict``, ``stream_options``, …).

Output: one line per case (``PASS``/``FAIL``/``SKIP``; ``CLIENT`` when the client itself refuses
the feature for OpenAI-API models before sending anything; seconds, detail) and a JSON summary
(``--json PATH`` writes it). Cases are small (``max_tokens`` ≤ 200): the default model is a 135M
one, so a case checks that the client's protocol works (a parsed object, a tool call, text), not
the answer's quality.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, List, Optional

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from client_compat_cases import cases  # noqa: E402  (the cases live beside this script)


# ----------------------------------------------------------------------------- server + proxy
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, extra: List[str], timeout: float = 600.0):
    """``sglite serve`` in a child process; returns (process, url, log file)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+b", prefix="sglite-client-compat-", suffix=".log", delete=False)
    cmd = [python, "-m", "sglite.launch_server", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"server not healthy after {timeout:.0f} s; log: {log.name}")


class Recorder:
    """Request bodies seen by the proxy, grouped by the case running."""

    def __init__(self):
        self.lock = threading.Lock()
        self.case = "-"
        self.requests: dict = {}

    def add(self, method: str, path: str, body: Optional[dict]) -> None:
        with self.lock:
            self.requests.setdefault(self.case, []).append({"method": method, "path": path, "body": body})


def start_proxy(upstream: str, rec: Recorder):
    """A threaded HTTP proxy on a free port that records JSON bodies; returns its URL."""
    client = httpx.Client(base_url=upstream, timeout=600)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _forward(self):
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = {"<non-json>": raw[:200].decode(errors="replace")}
            rec.add(self.command, self.path, body)
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization", "accept")}
            with client.stream(self.command, self.path, content=raw, headers=headers) as up:
                self.send_response(up.status_code)
                ctype = up.headers.get("content-type", "application/json")
                self.send_header("content-type", ctype)
                streaming = ctype.startswith("text/event-stream")
                if streaming:
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for chunk in up.iter_raw():
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    data = up.read()
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _forward

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"




# ----------------------------------------------------------------------------- report
NOTABLE = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "logprobs",
           "top_logprobs", "n", "stop", "temperature", "max_tokens", "max_completion_tokens", "seed", "echo",
           "extra_body", "functions", "function_call", "strict", "user", "metadata", "store")


def summarize_requests(reqs: list) -> list:
    """Per request: path, body keys, and the shape of response_format / tools / tool_choice."""
    lines = []
    for r in reqs:
        b = r["body"] if isinstance(r["body"], dict) else {}
        d = {"path": r["path"], "keys": sorted(b)}
        rf = b.get("response_format")
        if isinstance(rf, dict):
            js = rf.get("json_schema") or {}
            d["response_format"] = {"type": rf.get("type"), "strict": js.get("strict"),
                                    "schema_has_defs": "$defs" in json.dumps(js.get("schema", {})),
                                    "additionalProperties": "additionalProperties" in json.dumps(js)}
        if b.get("tools"):
            fn = b["tools"][0].get("function", {})
            d["tools"] = {"n": len(b["tools"]), "strict": fn.get("strict"),
                          "params_has_defs": "$defs" in json.dumps(fn.get("parameters", {}))}
        if "tool_choice" in b:
            d["tool_choice"] = b["tool_choice"]
        lines.append(d)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--model-path", default=None, help="sglite serve --model-path (default: the default model)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra sglite serve flag (repeatable)")
    ap.add_argument("--url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--only", default=None, help="run only the cases of this client")
    ap.add_argument("--json", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)

    proc = None
    if args.url:
        upstream, log = args.url.rstrip("/"), None
    else:
        extra = (["--model-path", args.model_path] if args.model_path else []) + args.server_arg
        t0 = time.perf_counter()
        proc, upstream, log = start_server(args.server_python, extra)
        print(f"server up in {time.perf_counter() - t0:.1f} s at {upstream} (log {log})", flush=True)
    rec = Recorder()
    proxy, base = start_proxy(upstream, rec)
    results = []
    try:
        model = httpx.get(upstream + "/v1/models", timeout=30).json()["data"][0]["id"]
        for client, name, fn in cases(base, model):
            if args.only and client != args.only:
                continue
            rec.case = f"{client} / {name}"
            t0 = time.perf_counter()
            try:
                detail, status = fn(), "PASS"
            except ImportError as e:
                detail, status = f"not installed: {e}", "SKIP"
            except Exception as e:  # noqa: BLE001 - the report records every failure
                tb = traceback.extract_tb(e.__traceback__)
                where = f" at {tb[-1].filename.split('site-packages/')[-1]}:{tb[-1].lineno}" if tb else ""
                # raised by the client before it sent anything: a feature the client lacks for OpenAI models
                status = "FAIL" if rec.requests.get(rec.case) else "CLIENT"
                detail = f"{type(e).__name__}: {str(e)[:400]}{where}"
            dt = time.perf_counter() - t0
            sent = summarize_requests(rec.requests.get(rec.case, []))
            results.append({"client": client, "case": name, "status": status, "seconds": round(dt, 1),
                            "detail": str(detail)[:500], "requests": sent})
            print(f"{status:6} {dt:6.1f}s  {client:16} {name:48} {str(detail)[:160]}", flush=True)
    finally:
        proxy.shutdown()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "CLIENT", "SKIP")}
    print(json.dumps(counts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1)
    return 0 if counts["FAIL"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
