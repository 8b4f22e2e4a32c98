"""Constrained decoding end to end on the default model (SmolLM2, the shared float32 engine):
JSON Schema outputs parse and validate, regex outputs fullmatch, EBNF outputs are in the language,
and everything finishes with ``stop`` before ``max_new_tokens``, also when a logit bias pushes the
model towards whitespace. Jump-forward on vs off is compared on a pair of tiny-model engines.

The schemas come from the JSON-Schema-Bench sample in ``tests/data`` (skipped when absent),
narrowed so that their language is finite (strings at most 10 characters, at most 2 array items,
bounded integers instead of free numbers, no additional properties): the small model may legally
write a string forever, and a finite language lets the test compute, per schema, an upper bound on
the output's length. What is then tested is the engine and the grammar: the bitmask, EOS exactly at
the end, bounded whitespace, and finishing with ``stop`` when the grammar is complete.
"""
import json
import re
from pathlib import Path

import pytest

# evaluation data (see SOURCE.txt there: schemas under their projects' terms; tests only, never packaged)
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench" / "maskbench_sample.jsonl"
WS_BIAS = {216: 5.0, 198: 5.0, 197: 5.0}  # " ", "\n", "\t" in the SmolLM2 vocabulary
N_SCHEMAS = 20
MAX_BOUND = 320  # longest allowed output (bytes) of a selected schema


def _narrow(s):
    """A schema accepting a finite subset of what ``s`` accepts (see the module docstring)."""
    if isinstance(s, list):
        return [_narrow(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: _narrow(v) if k in ("items", "additionalItems", "not") else v for k, v in s.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(s.get(k), dict):
            out[k] = {n: _narrow(v) for n, v in s[k].items()}
    for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(s.get(k), list):
            out[k] = [_narrow(v) for v in s[k]]
    types = s.get("type")
    tl = [types] if isinstance(types, str) else list(types or [])
    if "number" in tl:
        tl = ["integer" if t == "number" else t for t in tl]
        out["type"] = tl[0] if isinstance(types, str) else tl
    if "integer" in tl:
        out["minimum"] = max(s.get("minimum", -999), -999)
        out["maximum"] = min(s.get("maximum", 999), 999)
    if "string" in tl and not {"enum", "const", "pattern", "format"} & set(s):
        out["maxLength"] = min(s.get("maxLength", 10), 10)
    if "array" in tl or "items" in s:
        out["maxItems"] = max(min(s.get("maxItems", 2), 2), s.get("minItems", 0))
    if ("object" in tl or "properties" in s) and s.get("additionalProperties", True) is not False:
        out["additionalProperties"] = False
    return out


def _longest(compiled):
    """Longest sentence (bytes) of a single-DFA grammar, or None if its language is infinite."""
    if compiled.pushdown:
        return None
    dfa, memo, onpath = compiled.root, {}, set()

    def go(s):  # DFS; the DFAs here are small (a few thousand states)
        if s in memo:
            return memo[s]
        if s in onpath:
            raise OverflowError
        onpath.add(s)
        best = 0
        live = dfa.live_bytes(s)  # expands s first (may reallocate dfa.trans)
        for t in set(dfa.trans[s][live].tolist()):
            best = max(best, 1 + go(t))
        onpath.discard(s)
        memo[s] = best
        return best

    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        return go(dfa.start)
    except OverflowError:
        return None
    finally:
        sys.setrecursionlimit(limit)


# The ids select_cases picks from the whole sample (an even spread over the usable schemas):
# compiling all 310 schemas to find them takes ~30 s, so the fast tier compiles only these and the
# slow test below checks that the list is still what the full selection gives.
SELECTED_IDS = [
    "Github_easy---o11513", "Github_easy---o27248", "Github_easy---o43977", "Github_easy---o73016",
    "Github_easy---o85254", "Github_medium---o90710", "Github_trivial---o46560",
    "Glaiveai2K---book_flight_5ede04d0", "Glaiveai2K---calculate_area_7d9fd253",
    "Glaiveai2K---calculate_area_cdde5279", "Glaiveai2K---calculate_mortgage_payment_a15bb592",
    "Glaiveai2K---calculate_volume_8bfb0169", "Glaiveai2K---find_hotels_8ec3215e",
    "Glaiveai2K---generate_password_d0440b17", "JME_20", "JME_92", "Kubernetes---kb_11_Normalized",
    "MCPspec---GetPromptRequest", "Snowplow---sp_168_Normalized", "WashingtonPost---wp_101_Normalized"
]


def select_cases(backend, only=None):
    """(original schema, narrowed schema, max_new_tokens) for N_SCHEMAS sample schemas (``only``:
    consider just these ids, e.g. :data:`SELECTED_IDS`)."""
    from sglite.errors import GrammarError

    recs = sorted((json.loads(line) for line in SAMPLE.read_text().splitlines()), key=lambda r: r["id"])
    if only is not None:
        recs = [r for r in recs if r["id"] in set(only)]
    out = []
    for r in recs:
        narrow = _narrow(r["schema"])
        if len(json.dumps(narrow)) > 1500:
            continue
        try:
            bound = _longest(backend.compile("json_schema", narrow))
        except (GrammarError, RecursionError):
            continue
        if bound is not None and 40 <= bound <= MAX_BOUND:  # skip "{}"-only schemas
            out.append((r["schema"], narrow, bound + 1))  # a token is >= 1 byte; +1 for EOS
    step = len(out) / N_SCHEMAS
    return [out[int(i * step)] for i in range(N_SCHEMAS)] if len(out) >= N_SCHEMAS else out


@pytest.fixture(scope="module")
def cases(real_engine):
    if not SAMPLE.is_file():
        pytest.skip(f"{SAMPLE} not found")
    out = select_cases(real_engine.requests.grammar_backend, only=SELECTED_IDS)
    if len(out) < N_SCHEMAS:
        pytest.skip(f"only {len(out)} usable schemas in the sample")
    return out


@pytest.mark.slow
def test_selected_ids_are_the_full_selection(real_engine):
    if not SAMPLE.is_file():
        pytest.skip(f"{SAMPLE} not found")
    full = select_cases(real_engine.requests.grammar_backend)
    recs = {json.dumps(json.loads(line)["schema"], sort_keys=True): json.loads(line)["id"]
            for line in SAMPLE.read_text().splitlines()}
    assert [recs[json.dumps(orig, sort_keys=True)] for orig, _, _ in full] == SELECTED_IDS


def _prompt(schema):
    return f"Write a JSON object that matches this JSON Schema.\nSchema: {json.dumps(schema)[:300]}\nJSON: "


@pytest.mark.slow  # the real default model (real_engine)
@pytest.mark.parametrize("bias", [None, WS_BIAS], ids=["plain", "whitespace_bias"])
def test_json_schema_outputs_validate_and_stop(real_engine, cases, bias):
    jsonschema = pytest.importorskip("jsonschema")
    params = [{"max_new_tokens": n, "temperature": 0, "json_schema": narrow,
               **({"logit_bias": {str(k): v for k, v in bias.items()}} if bias else {})}
              for _, narrow, n in cases]
    outs = real_engine.generate([_prompt(orig) for orig, _, _ in cases], params)
    for (orig, narrow, n), o in zip(cases, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (o["meta_info"], o["text"], narrow)
        assert o["meta_info"]["completion_tokens"] < n
        value = json.loads(o["text"])
        jsonschema.validate(value, narrow)
        jsonschema.validate(value, orig)


REGEXES = [
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3} years old\.",
    r"(yes|no|maybe)(, because [a-z ]{1,20})?",
    r"\(\d{3}\) \d{3}-\d{4}",
]
EXPR = r'''
root   ::= expr
expr   ::= term (ws ("+" | "-") ws term){0,3}
term   ::= factor (ws ("*" | "/") ws factor){0,2}
factor ::= [1-9] [0-9]? | "(" expr ")"
ws     ::= " "?
'''


def _expr_value(text: str):
    """Parses ``text`` with the EXPR grammar (recursive descent); raises ValueError if not in it."""
    pos = 0

    def eat(ch):
        nonlocal pos
        if text.startswith(ch, pos):
            pos += len(ch)
            return True
        return False

    def ws():
        eat(" ")

    def factor():
        nonlocal pos
        if eat("("):
            expr()
            if not eat(")"):
                raise ValueError(f"')' expected at {pos}")
            return
        m = re.compile(r"[1-9][0-9]?").match(text, pos)
        if not m:
            raise ValueError(f"factor expected at {pos}")
        pos = m.end()

    def chain(item, ops, most):
        nonlocal pos
        item()
        for _ in range(most):
            save = pos
            ws()
            if not any(eat(o) for o in ops):
                pos = save
                return
            ws()
            item()

    def expr():
        chain(lambda: chain(factor, "*/", 2), "+-", 3)

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos}")


def test_expr_checker_rejects():
    for bad in ("1+", "(1", "1 ++ 2", "0", "1+2+3+4+5"):
        with pytest.raises(ValueError):
            _expr_value(bad)
    _expr_value("(12 * 3) - 4/5")


@pytest.mark.slow  # the real default model (real_engine)
@pytest.mark.parametrize("bias", [None, WS_BIAS], ids=["plain", "whitespace_bias"])
def test_regex_and_ebnf_outputs(real_engine, bias):
    extra = {"logit_bias": {str(k): v for k, v in bias.items()}} if bias else {}
    prompts = ["Today's date: ", "Describe a person: ", "Should I go? ", "Phone: ", "A small arithmetic expression: "]
    params = [{"max_new_tokens": 64, "temperature": 0, "regex": rx, **extra} for rx in REGEXES]
    params.append({"max_new_tokens": 96, "temperature": 0, "ebnf": EXPR, **extra})
    outs = real_engine.generate(prompts, params)
    for rx, o in zip(REGEXES, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (rx, o)
        assert re.fullmatch(rx, o["text"]), (rx, o["text"])
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "stop", outs[-1]
    _expr_value(outs[-1]["text"])


# ---------------------------------------------------------------- jump-forward on vs off (tiny model)
FORCED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"enum": ["Alice", "Bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 9},
                         "city": {"enum": ["Paris", "Rome"]}}}
# The claim under test: with jump-forward the text is the same as without it whenever the model
# would itself have produced the forced strings' canonical tokens. A random tiny model would not, so
# biases make it: " " (+100) wins every whitespace slot, and the canonical tokens of the forced pieces
# and of the chosen values (+50) win where they are allowed.
PIECES = ['{', '"name"', '"age"', '"city"', ':', ',', '"', '}', 'Bob', '7', 'Rome']


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    from sglite import Engine

    engines = {jf: Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096,
                          enable_jump_forward=jf) for jf in (True, False)}
    yield engines
    for e in engines.values():
        e.shutdown()


def test_jump_forward_same_text_fewer_steps(tiny_pair):
    tok = tiny_pair[True].tokenizer
    pin = {str(t): 50.0 for p in PIECES for t in tok.encode(p)}
    pin[str(tok.encode(" ")[0])] = 100.0
    out, steps = {}, {}
    for jf, e in tiny_pair.items():
        before = e.get_server_info()["steps"]
        out[jf] = e.generate("Person: ", {"max_new_tokens": 64, "temperature": 0, "json_schema": FORCED,
                                          "logit_bias": pin})
        steps[jf] = e.get_server_info()["steps"] - before
    assert out[True]["meta_info"]["finish_reason"]["type"] == "stop"
    assert out[True]["text"] == out[False]["text"], (out[True]["text"], out[False]["text"])
    assert json.loads(out[True]["text"]) == {"name": "Bob", "age": 7, "city": "Rome"}
    assert steps[True] < steps[False], steps


@pytest.mark.parametrize("pattern,sep", [(None, '","'), ("[ ]", '" , "')])
def test_json_whitespace_pattern_engine_option(tiny_model_dir, pattern, sep):
    from sglite import Engine

    e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096,
               constrained_json_whitespace_pattern=pattern)
    try:
        out = e.generate("Person: ", {"max_new_tokens": 64, "temperature": 0, "json_schema": FORCED})
    finally:
        e.shutdown()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    value = json.loads(out["text"])
    assert set(value) == {"name", "age", "city"}
    if pattern is None:  # compact by default
        assert out["text"] == json.dumps(value, separators=(",", ":"))
    else:  # exactly one space around every separator and bracket
        assert out["text"].startswith("{ ") and sep in out["text"] and out["text"].endswith(" }")
