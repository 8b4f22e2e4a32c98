"""TurnTokens (sglite.server.turn_tokens): generated assistant turns come back as their own ids.

The default model's tokenizer and chat template (SmolLM2's ChatML); the generated ids are a
deliberately non-canonical split, as a model under a grammar writes them.
"""
import pytest

from sglite.server.turn_tokens import TurnTokens, message_key

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


def _non_canonical(tok, text):
    """Ids of ``text`` one character at a time (decodes to ``text``; never the canonical split)."""
    ids = [i for ch in text for i in tok.encode(ch)]
    assert tok.decode(ids) == text and ids != tok.encode(text)
    return ids


def test_key_ignores_call_ids_and_argument_spelling():
    a = message_key(None, [("f", '{"x": 1, "y": [1, 2]}')])
    assert a == message_key("", [("f", {"y": [1, 2], "x": 1})]) == message_key("  ", [("f", '{"y":[1,2],"x":1}')])
    assert a != message_key(None, [("f", '{"x": 2, "y": [1, 2]}')]) != message_key(None, [("g", '{"x": 1}')])
    assert message_key("hi", []) != message_key("ho", [])


def test_generated_ids_are_spliced_into_the_resent_history(real_tokenizer):
    tok = real_tokenizer
    mem = TurnTokens(tok)
    gen = _non_canonical(tok, CALL_TEXT)
    eos = tok.encode("<|im_end|>")
    # the engine's ids end with the end-of-turn token, which the text does not show
    assert mem.remember(None, [("get_weather", '{"city": "Paris"}')], CALL_TEXT, gen + eos)
    turn1 = [{"role": "user", "content": "Weather in Paris?"}]
    prompt1 = tok.apply_chat_template(turn1, add_generation_prompt=True)
    history = turn1 + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]
    subst, segs = mem.substitute(history)
    assert len(segs) == 1 and "tool_calls" not in subst[1] and history[1]["tool_calls"]
    text, ids = mem.splice(tok.apply_chat_template(subst, add_generation_prompt=True), segs)
    # turn 2's prompt: turn 1's prompt, then the output ids exactly as generated (the template
    # writes the end-of-turn token itself)
    head = tok.encode(prompt1) + gen + eos
    assert ids[:len(head)] == head
    assert text.startswith(prompt1 + CALL_TEXT + "<|im_end|>") and tok.decode(ids, skip_special_tokens=False) == text


def test_refusals_and_bound(real_tokenizer):
    tok = real_tokenizer
    mem = TurnTokens(tok, max_entries=2)
    assert not mem.remember("a", [], "a b", tok.encode("a c"))  # ids that are not the text
    assert not mem.remember("a", [], "", [])
    for word in ("one", "two", "three"):
        assert mem.remember(word, [], word, tok.encode(word))
    assert len(mem) == 2 and mem.lookup({"role": "assistant", "content": "one"}) is None
    assert mem.lookup({"role": "user", "content": "two"}) is None
    assert mem.lookup({"role": "assistant", "content": "two", "reasoning_content": "x"}) is None
    subst, segs = mem.substitute([{"role": "assistant", "content": "three"}])
    assert mem.splice("no marker here", segs) is None  # a template that dropped the message
    assert mem.substitute([{"role": "assistant", "content": "three"}], keep_last=True)[1] == []
    with pytest.raises(ValueError, match="max_entries"):
        TurnTokens(tok, max_entries=-1)


def test_chat_completions_resent_history_carries_the_generated_ids():
    """Over HTTP (chat completions, streamed, FakeEngine's byte tokens): the assistant message the
    client sends back (arguments re-serialized, another call id) is replaced by the output as
    generated, so turn 2's ids extend turn 1's prompt ids + output ids."""
    import json

    import openai

    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig
    from sglite.server.testing import FakeEngine

    reply = 'Checking.<tool_call>\n{"name": "get_weather",  "arguments": {"city":"Oslo"}}\n</tool_call>'
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    engine = FakeEngine(reply=reply, context_length=4096)
    with ServerThread(engine, ServerConfig(port=0)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        msgs = [{"role": "user", "content": "Weather in Oslo?"}]
        chunks = list(c.chat.completions.create(model="fake-model", messages=msgs, tools=[tool], stream=True,
                                                temperature=0))
        first = engine.calls[-1]
        call = next(ch.choices[0].delta.tool_calls[0] for ch in chunks
                    if ch.choices and ch.choices[0].delta.tool_calls and ch.choices[0].delta.tool_calls[0].id)
        args = json.loads("".join(ch.choices[0].delta.tool_calls[0].function.arguments or "" for ch in chunks
                                  if ch.choices and ch.choices[0].delta.tool_calls))
        msgs += [{"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_other", "type": "function",
             "function": {"name": call.function.name, "arguments": json.dumps(args, indent=1)}}]},
            {"role": "tool", "tool_call_id": "call_other", "content": "sunny"}]
        c.chat.completions.create(model="fake-model", messages=msgs, tools=[tool], temperature=0)
        second = engine.calls[-1]
    ids1 = first["input_ids"] or list(first["prompt"].encode())
    head = ids1 + list(reply.encode())
    assert second["input_ids"][:len(head)] == head
    assert "sunny" in second["text"] and reply in second["text"]


def test_each_conversation_gets_its_own_ids_for_the_same_message(real_tokenizer):
    """Two conversations make the same call with different splits (the model chose them in its
    context); the one that ran last must not overwrite the other's: each resent history is
    spliced with the ids generated after its own prompt, so both prefixes stay token-exact."""
    tok = real_tokenizer
    mem = TurnTokens(tok)
    call = [("get_weather", '{"city": "Paris"}')]
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    turns, ids_of = {}, {}
    for conv, split in (("A", _non_canonical(tok, CALL_TEXT)), ("B", tok.encode(CALL_TEXT))):
        turns[conv] = [{"role": "user", "content": f"Conversation {conv}: weather in Paris?"}]
        prompt = tok.apply_chat_template(turns[conv], add_generation_prompt=True)
        assert mem.remember(None, call, CALL_TEXT, split, prompt=prompt)
        ids_of[conv] = tok.encode(prompt) + split
    assert ids_of["A"][-5:] != ids_of["B"][-5:]
    for conv in ("A", "B"):
        history = turns[conv] + [msg, {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]
        subst, segs = mem.substitute(history)
        text, ids = mem.splice(tok.apply_chat_template(subst, add_generation_prompt=True), segs)
        assert ids[:len(ids_of[conv])] == ids_of[conv], conv
    # a history whose text before the call was never a prompt: the latest turn (B's split)
    other = [{"role": "user", "content": "Another context"}, msg]
    subst, segs = mem.substitute(other)
    text, ids = mem.splice(tok.apply_chat_template(subst, add_generation_prompt=False), segs)
    head, latest = tok.encode(tok.apply_chat_template(other[:1], add_generation_prompt=True)), tok.encode(CALL_TEXT)
    assert ids[:len(head) + len(latest)] == head + latest


def test_the_pieces_between_turns_are_tokenized_in_one_call_with_the_same_ids(real_tokenizer):
    """``Tokenizer.encode_many`` gives :meth:`encode`'s ids for each text (special-token strings,
    leading spaces, non-ASCII, empty), and a splice through it equals one through per-piece calls."""
    tok = real_tokenizer
    texts = ["", "<|im_start|>user\nWeather in Paris?<|im_end|>\n", " {\"city\"", "é中文 🙂", "\n\n", "a" * 300]
    assert tok.encode_many(texts) == [tok.encode(t) for t in texts]

    class PerPiece:  # the same tokenizer without encode_many
        def __init__(self, t):
            self.encode, self.decode = t.encode, t.decode

    fast, slow = TurnTokens(tok), TurnTokens(PerPiece(tok))
    history = [{"role": "user", "content": "Weather in Paris?"}]
    for city in ("Paris", "Oslo", "Rome"):
        args, text = '{"city": "%s"}' % city, CALL_TEXT.replace("Paris", city)
        for mem in (fast, slow):
            assert mem.remember(None, [("get_weather", args)], text, _non_canonical(tok, text))
        history += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "c", "content": f"sunny in {city}"}]
    subst, segs = fast.substitute(history)
    assert len(segs) == 3
    rendered = tok.apply_chat_template(subst, add_generation_prompt=True)
    assert fast.splice(rendered, segs) == slow.splice(rendered, slow.substitute(history)[1])


def test_repeated_pieces_come_from_the_cache(real_tokenizer):
    """The text between turns that comes back every turn (system prompt, tool list) is tokenized
    once: a second splice of the same prompt asks the tokenizer for nothing, gives the same ids,
    and the cache keeps at most ``max_entries`` pieces."""
    tok = real_tokenizer
    asked = []

    class Counting:
        def __init__(self, t):
            self.encode, self.decode = t.encode, t.decode

        def encode_many(self, texts):
            asked.extend(texts)
            return tok.encode_many(texts)

    mem = TurnTokens(Counting(tok), max_entries=2)
    text = CALL_TEXT
    assert mem.remember(None, [("get_weather", '{"city": "Paris"}')], text, _non_canonical(tok, text))
    history = [{"role": "system", "content": "Call get_weather. " * 20}, {"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    subst, segs = mem.substitute(history)
    rendered = tok.apply_chat_template(subst, add_generation_prompt=True)
    first = mem.splice(rendered, segs)
    assert len(asked) == 2 and first is not None
    assert first == mem.splice(rendered, segs) and len(asked) == 2  # both pieces cached
    mem._encode_many(["x", "y", "z"])
    assert len(mem._gaps) == 2
