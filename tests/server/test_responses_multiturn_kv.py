"""Multi-turn KV of ``/v1/responses`` on the real Engine (tiny random model, SmolLM2's tokenizer
and chat template, fast, CPU):

* a stored response's conversation prefix stays pinned: after other traffic has evicted the whole
  LRU cache, the ``previous_response_id`` follow-up still finds its prefix cached (and without
  pins, ``--responses-pin-tokens 0``, it does not);
* the follow-up's rendered prompt extends the previous prompt plus its output token for token,
  with tool calls and tool results (measured as ``cached_tokens``), and resending the full
  history hits the cache as well as ``previous_response_id`` does.
"""
import httpx
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
POOL = 3072


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=POOL)
    yield eng
    eng.shutdown()


def _post(url, **body):
    r = httpx.post(url + "/v1/responses", json={"model": "x", "temperature": 0, "max_output_tokens": 24,
                                                "tools": [TOOL], **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _flood(url, rounds=6):
    """Unrelated prompts whose KV, together, is several times the pool: LRU evicts everything unpinned."""
    for i in range(rounds):
        text = f"Unrelated document {i}: " + " ".join(f"w{i}x{j}" for j in range(300))
        r = httpx.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert r.status_code == 200, r.text


def _turn2_cached(engine, pin_tokens):
    engine.flush_cache()
    with ServerThread(engine, ServerConfig(port=0, served_model_name="x", responses_pin_tokens=pin_tokens)) as srv:
        first = _post(srv.url, input="What is the weather in Paris?", tool_choice="required")
        call = next(o for o in first["output"] if o["type"] == "function_call")
        srv.app.state.responses_pins.drain()  # the pin is taken after the response is sent
        _flood(srv.url)
        second = _post(srv.url, previous_response_id=first["id"], tool_choice="auto", input=[
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    return first["usage"]["input_tokens"], second["usage"]["input_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_pinned_conversation_survives_eviction(engine):
    p1, cached = _turn2_cached(engine, pin_tokens=1024)
    assert cached >= p1 - 1, f"turn 2 found {cached} of turn 1's {p1} prompt tokens cached"
    p1, cached_unpinned = _turn2_cached(engine, pin_tokens=0)
    assert cached_unpinned < p1 // 2, "without pins the flood evicts the conversation"


class _Recorder:
    """Wraps ``engine.async_generate`` (non-streamed calls): each call's prompt ids (the text
    tokenized when it was sent as text) and output ids."""

    def __init__(self, engine, monkeypatch):
        self.calls, inner = [], engine.async_generate

        async def generate(**kw):
            out = await inner(**kw)
            ids = kw.get("input_ids") or engine.tokenizer.encode(kw["prompt"])
            self.calls.append((list(ids), list(out["output_ids"])))
            return out
        monkeypatch.setattr(engine, "async_generate", generate)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_follow_up_prompt_extends_previous_prompt_and_output(engine, tool_choice, monkeypatch):
    engine.flush_cache()
    rec = _Recorder(engine, monkeypatch)
    with ServerThread(engine, ServerConfig(port=0, served_model_name="x")) as srv:
        first = _post(srv.url, input="What is the weather in Paris?", tool_choice=tool_choice)
        use1 = first["usage"]
        call = next((o for o in first["output"] if o["type"] == "function_call"), None)
        new = ([{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}] if call else
               [{"role": "user", "content": "And in Oslo?"}])
        chained = _post(srv.url, previous_response_id=first["id"], input=new)
        resent = _post(srv.url, store=False, input=[{"role": "user", "content": "What is the weather in Paris?"},
                                                    *first["output"], *new])
    c2 = chained["usage"]["input_tokens_details"]["cached_tokens"]
    c3 = resent["usage"]["input_tokens_details"]["cached_tokens"]
    print(f"tool_choice={tool_choice}: turn 1 prompt {use1['input_tokens']} + output {use1['output_tokens']}; "
          f"turn 2 prompt {chained['usage']['input_tokens']}, cached {c2} (full history resent: cached {c3})")
    # turn 1's prompt ids and output ids, as generated (turn_tokens splices them back), are a
    # token-exact prefix of turn 2's prompt ids, chained or resent
    (p1, o1), (p2, _), (p3, _) = rec.calls
    assert p2[:len(p1) + len(o1)] == p1 + o1[:len(p2) - len(p1)] and len(p2) > len(p1) + len(o1) - 1
    assert p3 == p2
    # ... and the cache holds them: all but the last output token (no KV yet) and, when the limit
    # cut a forced call right after a jump-forward, the forced tokens appended without a step
    assert c2 >= use1["input_tokens"] + use1["output_tokens"] - (1 if tool_choice == "auto" else 6)
    # resending the history renders the same prompt as previous_response_id does
    assert resent["usage"]["input_tokens"] == chained["usage"]["input_tokens"] and c3 >= c2 - 1


def test_store_reports_every_dropped_entry():
    """on_drop (the unpin hook) hears of every entry that leaves: replaced, evicted, expired, deleted."""
    from sglite.server.responses_store import ResponseStore, StoredResponse

    now, dropped = [0.0], []
    store = ResponseStore(max_size=2, ttl=10, clock=lambda: now[0], on_drop=dropped.append)
    entry = StoredResponse({}, [], [])
    store.put("a", entry)
    store.put("a", entry)                      # replaced
    store.put("b", entry)
    store.put("c", entry)                      # evicts the oldest, "a"
    assert dropped == ["a", "a"]
    assert store.delete("b") and not store.delete("b")
    now[0] = 11.0
    assert store.get("c") is None              # expired
    assert dropped == ["a", "a", "b", "c"]
    ResponseStore(max_size=0, on_drop=dropped.append).put("z", entry)
    assert dropped[-1] == "z"                  # never kept
