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
MAX_TOKENS = 200


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


# ----------------------------------------------------------------------------- cases
def pydantic_models():
    from typing import List as TList

    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        country: str

    class User(BaseModel):
        name: str
        age: int

    class UserWithAddress(BaseModel):
        name: str
        age: int
        address: Address

    class Team(BaseModel):
        members: TList[User]

    return User, UserWithAddress, Team


PROMPT_USER = "Extract the user: Jason is 25 years old and lives in Paris, France."
PROMPT_USERS = "Extract every user: Jason is 25 years old. Sarah is 30 years old."


def cases(base: str, model: str) -> List[tuple]:
    """``(client, case, fn)``; ``fn()`` returns a short detail string or raises."""
    v1 = base + "/v1"
    User, UserWithAddress, Team = pydantic_models()
    out: List[tuple] = []

    def case(client, name):
        def deco(fn):
            out.append((client, name, fn))
            return fn
        return deco

    # ---------------------------------------------------------------- openai
    def oa():
        import openai
        return openai.OpenAI(base_url=v1, api_key="EMPTY")

    @case("openai", "chat")
    def _():
        r = oa().chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=16, temperature=0)
        assert r.choices[0].message.content, r
        return repr(r.choices[0].message.content[:40])

    @case("openai", "chat stream + usage")
    def _():
        s = oa().chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 5."}],
                                         max_tokens=16, stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        for ch in s:
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            usage = ch.usage or usage
        assert parts and usage is not None
        return f"{len(parts)} chunks, usage {usage.completion_tokens}"

    @case("openai", "completions logprobs")
    def _():
        r = oa().completions.create(model=model, prompt="The capital of France is", max_tokens=5, logprobs=2,
                                    temperature=0)
        lp = r.choices[0].logprobs
        assert lp and len(lp.tokens) == len(lp.token_logprobs)
        return repr(r.choices[0].text)

    @case("openai", "response_format json_schema strict")
    def _():
        r = oa().chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT_USER}], max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "User", "strict": True,
                                                                     "schema": UserWithAddress.model_json_schema()}})
        obj = UserWithAddress.model_validate_json(r.choices[0].message.content)
        return obj.model_dump_json()

    @case("openai", "beta.parse (pydantic)")
    def _():
        c = oa()
        parse = getattr(getattr(c, "beta", None), "chat", None)
        parse = parse.completions.parse if parse is not None else c.chat.completions.parse
        r = parse(model=model, messages=[{"role": "user", "content": PROMPT_USER}], response_format=User,
                  max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.parsed is not None
        return repr(r.choices[0].message.parsed)

    @case("openai", "tools tool_choice=required")
    def _():
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}, "required": ["city"]}}}]
        r = oa().chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=tools, tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
        tc = r.choices[0].message.tool_calls
        assert tc and json.loads(tc[0].function.arguments)["city"]
        return f"{tc[0].function.name}({tc[0].function.arguments})"

    # ---------------------------------------------------------------- instructor
    def inst(mode_name):
        import instructor
        import openai
        return instructor.from_openai(openai.OpenAI(base_url=v1, api_key="EMPTY"),
                                      mode=getattr(instructor.Mode, mode_name))

    for mode in ("TOOLS", "JSON_SCHEMA", "JSON"):
        def make(mode=mode):
            def fn():
                u = inst(mode).chat.completions.create(
                    model=model, response_model=UserWithAddress, max_retries=1, temperature=0,
                    max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT_USER}])
                return u.model_dump_json()
            return fn
        out.append(("instructor", f"mode {mode} (nested model: $defs)", make()))

    @case("instructor", "partial streaming (TOOLS)")
    def _():
        partials = list(inst("TOOLS").chat.completions.create_partial(
            model=model, response_model=User, max_retries=1, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT_USER}]))
        assert partials and isinstance(partials[-1].age, int), partials[-1:]
        return f"{len(partials)} partials, last {partials[-1]!r}"

    @case("instructor", "iterable (TOOLS)")
    def _():
        users = list(inst("TOOLS").chat.completions.create_iterable(
            model=model, response_model=User, max_retries=1, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT_USERS}]))
        assert users
        return repr(users)

    @case("instructor", "iterable (JSON_SCHEMA)")
    def _():
        users = list(inst("JSON_SCHEMA").chat.completions.create_iterable(
            model=model, response_model=User, max_retries=1, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT_USERS}]))
        assert users
        return repr(users)

    # ---------------------------------------------------------------- langchain
    def lc():
        from langchain_openai import ChatOpenAI
        return ChatOpenAI(model=model, base_url=v1, api_key="EMPTY", temperature=0, max_tokens=MAX_TOKENS,
                          max_retries=0)

    for method in ("function_calling", "json_schema", "json_mode"):
        def make(method=method):
            def fn():
                prompt = PROMPT_USER + (" Answer in JSON with keys name, age, address{city,country}."
                                        if method == "json_mode" else "")
                r = lc().with_structured_output(UserWithAddress, method=method).invoke(prompt)
                assert isinstance(r, UserWithAddress), r
                return r.model_dump_json()
            return fn
        out.append(("langchain-openai", f"with_structured_output({method})", make()))

    @case("langchain-openai", "with_structured_output(json_schema, strict=True)")
    def _():
        r = lc().with_structured_output(UserWithAddress, method="json_schema", strict=True).invoke(PROMPT_USER)
        assert isinstance(r, UserWithAddress), r
        return r.model_dump_json()

    @case("langchain-openai", "bind_tools + tool_choice")
    def _():
        from langchain_core.tools import tool

        @tool
        def get_weather(city: str) -> str:
            """Get the weather of a city."""
            return "sunny"

        msg = lc().bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        return repr(msg.tool_calls[0]["args"])

    @case("langchain-openai", "stream")
    def _():
        chunks = [c.content for c in lc().stream("Say hi.")]
        assert "".join(chunks)
        return f"{len(chunks)} chunks"

    # ---------------------------------------------------------------- litellm
    @case("litellm", "completion")
    def _():
        import litellm
        r = litellm.completion(model=f"openai/{model}", api_base=v1, api_key="EMPTY", max_tokens=16, temperature=0,
                               messages=[{"role": "user", "content": "Say hi."}])
        assert r.choices[0].message.content
        return repr(r.choices[0].message.content[:40])

    @case("litellm", "response_format pydantic")
    def _():
        import litellm
        r = litellm.completion(model=f"openai/{model}", api_base=v1, api_key="EMPTY", max_tokens=MAX_TOKENS,
                               temperature=0, response_format=UserWithAddress,
                               messages=[{"role": "user", "content": PROMPT_USER}])
        return UserWithAddress.model_validate_json(r.choices[0].message.content).model_dump_json()

    @case("litellm", "tools")
    def _():
        import litellm
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        r = litellm.completion(model=f"openai/{model}", api_base=v1, api_key="EMPTY", max_tokens=MAX_TOKENS,
                               temperature=0, tools=tools,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               messages=[{"role": "user", "content": "Weather in Paris?"}])
        tc = r.choices[0].message.tool_calls
        assert tc, r
        return tc[0].function.arguments

    # ---------------------------------------------------------------- dspy
    @case("dspy", "Predict (ChatAdapter, JSONAdapter fallback)")
    def _():
        import dspy
        lm = dspy.LM(f"openai/{model}", api_base=v1, api_key="EMPTY", max_tokens=MAX_TOKENS, temperature=0,
                     cache=False)
        with dspy.context(lm=lm):
            r = dspy.Predict("question -> answer")(question="What is the capital of France?")
        assert isinstance(r.answer, str)
        return repr(r.answer[:60])

    @case("dspy", "Predict typed output (JSONAdapter)")
    def _():
        import dspy

        class Extract(dspy.Signature):
            """Extract the user's name and age."""
            text: str = dspy.InputField()
            name: str = dspy.OutputField()
            age: int = dspy.OutputField()

        lm = dspy.LM(f"openai/{model}", api_base=v1, api_key="EMPTY", max_tokens=MAX_TOKENS, temperature=0,
                     cache=False)
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            r = dspy.Predict(Extract)(text="Jason is 25 years old.")
        assert isinstance(r.age, int)
        return f"name={r.name!r} age={r.age}"

    # ---------------------------------------------------------------- outlines
    def outlines_model():
        import openai
        import outlines
        return outlines.from_openai(openai.OpenAI(base_url=v1, api_key="EMPTY"), model)

    @case("outlines", "text")
    def _():
        r = outlines_model()("Say hi.", max_tokens=16)
        assert isinstance(r, str) and r
        return repr(r[:40])

    @case("outlines", "pydantic output_type")
    def _():
        r = outlines_model()(PROMPT_USER, UserWithAddress, max_tokens=MAX_TOKENS)
        return UserWithAddress.model_validate_json(r).model_dump_json()

    @case("outlines", "Literal choice")
    def _():
        from typing import Literal
        r = outlines_model()("Is the sky blue? Answer yes or no.", Literal["yes", "no"], max_tokens=8)
        assert r in ("yes", "no") or json.loads(r) in ("yes", "no"), r
        return repr(r)

    # ---------------------------------------------------------------- guidance
    def guidance_model():
        import guidance
        return guidance.models.OpenAI(model, base_url=v1, api_key="EMPTY", echo=False)

    @case("guidance", "chat gen")
    def _():
        from guidance import assistant, gen, user
        lm = guidance_model()
        with user():
            lm += "Say hi."
        with assistant():
            lm += gen("answer", max_tokens=16, temperature=0)
        assert lm["answer"]
        return repr(lm["answer"][:40])

    @case("guidance", "json schema")
    def _():
        from guidance import assistant, json as gjson, user
        lm = guidance_model()
        with user():
            lm += PROMPT_USER
        with assistant():
            lm += gjson("user", schema=User, max_tokens=MAX_TOKENS)
        return User.model_validate_json(lm["user"]).model_dump_json()

    @case("guidance", "select")
    def _():
        from guidance import assistant, select, user
        lm = guidance_model()
        with user():
            lm += "Is the sky blue? yes or no."
        with assistant():
            lm += select(["yes", "no"], name="v")
        assert lm["v"] in ("yes", "no")
        return repr(lm["v"])

    return out


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
