"""JSON Schema → grammar: semantics on a byte vocabulary, the JSON Schema Test Suite, bad specs."""
import json
from pathlib import Path

import pytest

from sglite.bench.grammar_coverage import accepts, byte_backend, check_schema
from sglite.errors import GrammarError

SUITE = Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft2020-12"  # MIT, see LICENSE there


@pytest.fixture(scope="module")
def backend():
    return byte_backend()


@pytest.fixture(scope="module")
def flexible():
    from sglite.constrained import GrammarBackend
    from sglite.constrained.json_schema import FLEXIBLE_WS
    return GrammarBackend(byte_backend().info, whitespace_pattern=FLEXIBLE_WS)


def ok(backend, schema, text: str) -> bool:
    return accepts(backend.compile("json_schema", schema), text.encode())


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "kind": {"enum": ["a", "b"]}}}


@pytest.mark.parametrize("text,valid", [
    ('{"name":"bob","age":3}', True), ('{"name":"bob","age":150}', True), ('{"name":"bob","age":151}', False),
    ('{"name":"bob","age":-1}', False), ('{"name":"bobbyy","age":1}', False), ('{"age":3}', False),
    ('{"name":"b","age":3,"tags":[]}', False), ('{"name":"b","age":3,"tags":["x","y"]}', True),
    ('{"name":"b","age":3,"tags":["x","y","z"]}', False), ('{"name":"b","age":3,"zip":"12345"}', True),
    ('{"name":"b","age":3,"zip":"1234"}', False), ('{"name":"b","age":3,"kind":"c"}', False),
    ('{"name":"b","age":3,"extra":1}', False), ('{"name":"\\u00e9\\n","age":0}', True), ('{"name":"a\nb","age":0}', False),
])
def test_object_semantics(backend, text, valid):
    assert ok(backend, PERSON, text) == valid


def test_recursive_ref(backend):
    tree = {"$defs": {"n": {"type": "object", "required": ["v"], "additionalProperties": False, "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}
    assert backend.compile("json_schema", tree).pushdown
    assert ok(backend, tree, '{"v":1,"kids":[{"v":2,"kids":[{"v":3,"kids":[]}]},{"v":4}]}')
    assert not ok(backend, tree, '{"v":1,"kids":[{"v":2,"kids":[{"w":3}]}]}')


def test_number_bounds(backend):
    s = {"type": "number", "exclusiveMinimum": -2, "maximum": 10}
    for text, valid in [("-1.5", True), ("-2", False), ("-1.99", True), ("10", True), ("10.0", True),
                        ("10.01", False), ("0", True), ("3e2", False)]:
        assert ok(backend, s, text) == valid, text


def test_default_whitespace_is_compact(backend, flexible):
    assert ok(backend, PERSON, '{"name":"bob","age":150}')
    assert not ok(backend, PERSON, '{"name": "bob", "age": 150}')
    assert not ok(backend, {"type": "array"}, "[1, 2]") and ok(backend, {"type": "array"}, "[1,2]")
    assert ok(flexible, PERSON, '{"name": "bob", "age": 150}')


def test_whitespace_pattern_option(backend):
    from sglite.constrained import GrammarBackend
    tabs = GrammarBackend(backend.info, whitespace_pattern=r"\t?")
    assert ok(tabs, PERSON, '{\t"name":\t"bob",\t"age":1}')
    assert not ok(tabs, PERSON, '{ "name":"bob","age":1}')


def test_flexible_whitespace_is_bounded(flexible):
    backend = flexible
    assert ok(backend, {"type": "object"}, '{\n  "a": [1, 2]\n}')
    assert not ok(backend, {"type": "object"}, "{" + "\n" * 3 + "}")
    m = backend.compile("json_schema", {"type": "array"}).matcher()
    assert m.accept_string("[\n") and m.accept_string("\n")  # empty array: the two gaps meet
    assert not m.accept_token(ord("\n"))


def test_json_object_and_jump_forward(backend):
    assert accepts(backend.compile("json_object", None), b'{"a":{"b":[null,true,1.5e3,"x"]}}')
    assert not accepts(backend.compile("json_object", None), b"[1]")
    m = backend.compile("json_schema", {"type": "object", "properties": {"name": {"type": "string"}},
                                        "required": ["name"], "additionalProperties": False}).matcher()
    assert m.find_jump_forward_string() == '{"name":"'
    assert m.accept_string('{"') and m.find_jump_forward_string() == 'name":"'


@pytest.mark.parametrize("schema,needle", [
    ({"type": "not-a-type"}, "not-a-type"), ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "$ref"),
    ({"properties": {"x": {"not": {}}}}, "#/properties/x/not"), ({"$ref": "http://x/y"}, "local"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"type": "string", "format": "color"}, "format"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
     "no finite string"),
    ({"oneOf": [{"type": "string"}, {"maxLength": 3}]}, "oneOf"),
])
def test_bad_specs_raise(backend, schema, needle):
    with pytest.raises(GrammarError, match=None) as e:
        backend.compile("json_schema", schema)
    assert needle in str(e.value)


# Known, documented gaps (semantic checks a grammar over the text cannot make cheaply).
KNOWN = {
    ("const.json", "const with object"): "object key order differs from the const value",
    ("date-time.json", "validation of date-time strings"): "leap seconds / per-month day counts",
    ("date.json", "validation of date strings"): "leap years",
    ("time.json", "validation of time strings"): "leap seconds",
    ("email.json", "validation of e-mail addresses"): "quoted local parts and address literals",
    ("hostname.json", "validation of host names"): "total length limit",
    ("hostname.json", "validation of A-label (punycode) host names"): "IDNA rules",
    ("ipv6.json", "validation of IPv6 addresses"): "mixed IPv4 tail forms",
    ("uri.json", "validation of URIs"): "RFC 3986 details",
    ("type.json", "integer type matches integers"): "by design integers are emitted without a fraction (1.0 refused)",
}


def _groups():
    if not SUITE.is_dir():
        return []
    files = sorted(list(SUITE.glob("*.json")) + list(SUITE.glob("format/*.json")))
    return [pytest.param(f, id=f.name) for f in files]


@pytest.mark.skipif(not SUITE.is_dir(), reason="tests/data/json-schema-test-suite not present")
@pytest.mark.parametrize("path", _groups())
def test_json_schema_test_suite(backend, path):
    """Each group either raises GrammarError at compile time, or decides every instance right."""
    wrong = {}
    for group in json.loads(path.read_text()):
        status, bad = check_schema(backend, group["schema"], group["tests"])
        if status == "fail" and (path.name, group["description"]) not in KNOWN:
            wrong[group["description"]] = bad
    assert not wrong, wrong


# ---------------------------------------------------------------- keywords added for coverage
@pytest.mark.parametrize("lo,lo_ex,hi,hi_ex", [
    (0.25, False, None, False), (None, False, 2.75, True), (-3.125, True, -0.05, False), (0.01, False, 0.1, True),
    (-0.5, False, 0.5, False), (0.1, True, 100.5, False),
])
def test_decimal_bounds_agree_with_arithmetic(backend, lo, lo_ex, hi, hi_ex):
    from decimal import Decimal

    s = {"type": "number"}
    if lo is not None:
        s["exclusiveMinimum" if lo_ex else "minimum"] = lo
    if hi is not None:
        s["exclusiveMaximum" if hi_ex else "maximum"] = hi
    g = backend.compile("json_schema", s)
    texts = [f"{sign}{i}{f}" for sign in ("", "-") for i in (0, 1, 2, 3, 99, 100, 101)
             for f in ("", ".0", ".01", ".05", ".0500", ".09", ".1", ".125", ".25", ".2499", ".2501", ".5", ".75", ".9")]
    for t in texts:
        x = Decimal(t)
        want = ((lo is None or (x > Decimal(str(lo)) if lo_ex else x >= Decimal(str(lo))))
                and (hi is None or (x < Decimal(str(hi)) if hi_ex else x <= Decimal(str(hi)))))
        if want and t.startswith("-") and x == 0:
            continue  # "-0..." is refused by design (a sound narrowing)
        assert accepts(g, t.encode()) == want, (s, t)


def test_multiple_of(backend):
    s = {"type": "integer", "minimum": -40, "maximum": 40, "multipleOf": 16}
    for text, valid in [("-32", True), ("0", True), ("16", True), ("32", True), ("48", False), ("8", False)]:
        assert ok(backend, s, text) == valid, text
    cents = {"type": "number", "multipleOf": 0.01}
    for text, valid in [("1.25", True), ("-3", True), ("0.125", False), ("2.500", True), ("7.1", True)]:
        assert ok(backend, cents, text) == valid, text
    with pytest.raises(GrammarError, match="multipleOf"):
        backend.compile("json_schema", {"type": "number", "multipleOf": 0.3})


def test_enum_filtered_by_sibling_keywords(backend):
    s = {"type": "object", "properties": {"b": {"enum": ["x", 3, "yy"], "type": "string", "maxLength": 1}}}
    assert ok(backend, s, '{"b":"x"}')
    assert not ok(backend, s, '{"b":3}') and not ok(backend, s, '{"b":"yy"}')
    assert not ok(backend, {"properties": {"b": {"enum": ["A"], "type": "object"}}}, '{"b":"A"}')


def test_min_properties_one_and_match_all_pattern_properties(backend):
    assert not ok(backend, {"type": "object", "minProperties": 1}, "{}")
    assert ok(backend, {"type": "object", "minProperties": 1}, '{"a":1}')
    s = {"type": "object", "properties": {"basic": {"type": "string"}}, "required": ["basic"],
         "patternProperties": {".*": {"type": "string", "maxLength": 2}}}
    assert ok(backend, s, '{"basic":"ab","x":"y"}')
    assert not ok(backend, s, '{"basic":"abc"}')  # the pattern's schema applies to declared properties too
    assert not ok(backend, s, '{"basic":"a","x":1}')


def test_one_of_disjoint_by_required_and_forbidden(backend):
    s = {"type": "object", "oneOf": [
        {"additionalProperties": False, "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"additionalProperties": False, "properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    assert ok(backend, s, '{"a":"x"}') and ok(backend, s, '{"b":"x"}') and not ok(backend, s, '{"c":"x"}')
    with pytest.raises(GrammarError, match="oneOf"):  # untyped branches may both accept a non-object
        backend.compile("json_schema", {"oneOf": [{"required": ["a"]}, {"additionalProperties": False}]})


def test_pattern_properties_partition_keys(backend):
    s = {"type": "object", "properties": {"ab": {"type": "string"}},
         "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "integer", "minimum": 10}}}
    cases = [('{"ab":"x"}', False),  # "ab" matches both patterns: must be a string and an integer >= 10
             ('{"a1":5}', True), ('{"a1":"x"}', False), ('{"xb":5}', False), ('{"xb":10}', True),
             ('{"axb":5}', False), ('{"axb":12}', True), ('{"zz":"any"}', True), ('{"zz":[1]}', True)]
    for text, valid in cases:
        assert ok(backend, s, text) == valid, text
    closed = {"type": "object", "additionalProperties": False, "patternProperties": {"^[a-z]{2}$": {"type": "string"}}}
    assert ok(backend, closed, '{"en":"x","fr":"y"}') and not ok(backend, closed, '{"eng":"x"}')


def test_length_intersected_with_pattern_and_format(backend):
    s = {"type": "string", "pattern": "^[a-z]+[0-9]*$", "minLength": 3, "maxLength": 5}
    for text, valid in [('"ab"', False), ('"abc"', True), ('"ab12"', True), ('"abc123"', False), ('"1ab"', False)]:
        assert ok(backend, s, text) == valid, text
    email = {"type": "string", "format": "email", "maxLength": 12}
    assert ok(backend, email, '"a@b.co"') and not ok(backend, email, '"abcdefg@b.com"')


@pytest.mark.parametrize("extra,forced", [([], True), ([b'":"a'], False)])
def test_forces_token_text_sees_tokens_that_reach_past_the_forced_string(extra, forced):
    from sglite.constrained import GrammarBackend, TokenizerInfo
    vocab = [bytes([b]) for b in range(256)] + [b'":"', b'":', b"name"] + extra + [None]
    be = GrammarBackend(TokenizerInfo(vocab, {len(vocab) - 1}))
    m = be.compile("json_schema", {"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"], "additionalProperties": False}).matcher()
    assert m.accept_string('{"name') and m.find_jump_forward_string() == '":"'
    assert m.forces_token_text(256) == forced  # b'":"'
    assert not m.forces_token_text(257)  # b'":' is allowed, but so is b'":"', which is longer
    assert not m.forces_token_text(258)  # b"name" is not allowed here


def test_grammar_cache_is_lru_and_keeps_property_order():
    from sglite.constrained.grammar_cache import GrammarCache, cache_key

    a = {"properties": {"x": {}, "y": {}}}
    b = {"properties": {"y": {}, "x": {}}}
    assert cache_key("json_schema", a) != cache_key("json_schema", b)  # order decides the output order
    cache, calls = GrammarCache(max_size=2), []

    def compile_(name):
        calls.append(name)
        return name

    for name in ("r1", "r2", "r1", "r3", "r1", "r2"):  # r2 is the least recently used when r3 arrives
        assert cache.get_or_compile("regex", name, lambda n=name: compile_(n)) == name
    assert calls == ["r1", "r2", "r3", "r2"] and len(cache) == 2


# -- strict reading (XGrammar's default; the engine's default, json_schema_strict) ---------------
@pytest.fixture(scope="module")
def strict():
    return byte_backend(json_schema_strict=True)


def test_strict_is_the_backend_default():
    from sglite.constrained import GrammarBackend

    assert GrammarBackend(byte_backend().info).json_schema_strict is True


@pytest.mark.parametrize("schema,text,strict_ok,spec_ok", [
    # objects naming properties are closed unless they say additionalProperties
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', True, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1,"unit_type":"x"}', False, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"unit_title":2}', False, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     '{"a":1,"b":[2]}', True, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a":1,"b":"x"}', True, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a":1,"b":2}', False, False),
    # a required key the properties do not declare is still allowed (the schema names it)
    ({"type": "object", "required": ["k"]}, '{"k":[1,{"z":null}]}', True, True),
    ({"type": "object", "required": ["k"]}, '{"k":1,"j":2}', False, True),
    # nested objects close too
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "boolean"}}}}},
     '{"o":{"x":true,"y":1}}', False, True),
    # patternProperties: matching keys allowed, the others closed
    ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}}}, '{"n_a":1}', True, True),
    ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}}}, '{"m":1}', False, True),
    # a bare object / array is any object / array (XGrammar's basic_object)
    ({"type": "object"}, '{"anything":{"goes":[1]}}', True, True),
    ({"type": "array"}, '[1,"a",{"b":2}]', True, True),
    # arrays: no items past prefixItems when items is absent
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1,"a"]', True, True),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1,"a",3]', False, True),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": True}, '[1,"a",3]', True, True),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"}}, '[1,3]', True, True),
    ({"type": "array", "items": [{"type": "integer"}]}, '[1,2]', False, True),  # draft-4 tuple form
    # $ref targets and allOf merges follow the same reading
    ({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}, '{"p":{"x":1,"q":2}}', False, True),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"properties": {"b": {"type": "integer"}}}]}, '{"a":1,"b":2}', True, True),
])
def test_strict_and_spec_readings(backend, strict, schema, text, strict_ok, spec_ok):
    assert ok(strict, schema, text) == strict_ok
    assert ok(backend, schema, text) == spec_ok
