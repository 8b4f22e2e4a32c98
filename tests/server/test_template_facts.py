"""TemplateFacts: what the chat template does with tools is judged once on probe messages and
cached, so a tools request renders its (possibly long) history once; the prompts are the same as
judging on the request's own messages."""
import pytest

from sglite.server.template_facts import TemplateFacts
from sglite.server.tool_calls import ToolPlan, render_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class _Counting:
    """A ChatML fake engine that counts the messages it renders; ``shows_tools`` says whether the
    template lists ``tools``; ``renders_calls`` whether it renders assistant ``tool_calls``;
    ``strict`` rejects one-letter messages (as a template with its own checks may reject a probe)."""

    def __init__(self, shows_tools: bool, renders_calls: bool = False, strict: bool = False):
        self.shows_tools, self.renders_calls, self.strict = shows_tools, renders_calls, strict
        self.rendered = []  # the number of messages of each render

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, chat_template_kwargs=None):
        if self.strict and any(len(m.get("content") or "") == 1 for m in messages):
            raise ValueError("messages of one letter are not allowed")
        self.rendered.append(len(messages))
        head = ""
        if tools and self.shows_tools:
            head = "<|im_start|>system\nTools: " + ", ".join(t["function"]["name"] for t in tools) + "<|im_end|>\n"
        body = ""
        for m in messages:
            calls = "".join(c["function"]["name"] for c in m.get("tool_calls") or []) if self.renders_calls else ""
            body += f"<|im_start|>{m['role']}\n{m.get('content') or ''}{calls}<|im_end|>\n"
        return head + body + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _history(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "Call get_weather for every city."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Weather in city {t}?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": f"c{t}", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
                 {"role": "tool", "tool_call_id": f"c{t}", "content": "sunny"}]
    return msgs + [{"role": "user", "content": "And now?"}]


@pytest.mark.parametrize("shows_tools", [False, True], ids=["template-drops-tools", "template-lists-tools"])
@pytest.mark.parametrize("renders_calls", [False, True], ids=["calls-dropped", "calls-rendered"])
def test_cached_facts_give_the_same_prompt_and_render_the_history_once(shows_tools, renders_calls):
    plan = ToolPlan("auto", [WEATHER])
    msgs = _history(5)
    uncached = render_prompt(_Counting(shows_tools, renders_calls), msgs, plan)
    eng, facts = _Counting(shows_tools, renders_calls), TemplateFacts()
    first = render_prompt(eng, msgs, plan, facts=facts)
    assert first == uncached
    assert ("Tools: get_weather" in first) == shows_tools and ('"parameters"' in first) != shows_tools
    eng.rendered.clear()
    for turns in (6, 7):  # later turns of the same agent: only their own history is rendered
        longer = _history(turns)
        assert render_prompt(eng, longer, plan, facts=facts) == render_prompt(_Counting(shows_tools, renders_calls),
                                                                              longer, plan)
    assert eng.rendered == [len(_history(6)), len(_history(7))]


def test_facts_are_keyed_by_the_tool_list_and_the_system_message():
    eng, facts = _Counting(shows_tools=True), TemplateFacts()
    render = eng.apply_chat_template
    sys_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert facts.shows_tools(render, [WEATHER], sys_user) is True
    n = len(eng.rendered)
    assert facts.shows_tools(render, [WEATHER], _history(3)) is True and len(eng.rendered) == n  # same shape: cached
    assert facts.shows_tools(render, [WEATHER, CLOCK], sys_user) is True and len(eng.rendered) == n + 2
    assert facts.shows_tools(render, [WEATHER], sys_user[1:]) is True and len(eng.rendered) == n + 4
    assert facts.shows_tools(_Counting(shows_tools=False).apply_chat_template, [CLOCK], sys_user[1:]) is False


def test_the_cache_is_bounded_least_recently_used_first():
    eng, facts = _Counting(shows_tools=True), TemplateFacts(max_entries=2)
    render = eng.apply_chat_template
    tools = [[{"type": "function", "function": {"name": f"f{i}", "parameters": {}}}] for i in range(3)]
    user = [{"role": "user", "content": "Hi"}]
    facts.shows_tools(render, tools[0], user)
    facts.shows_tools(render, tools[1], user)
    facts.shows_tools(render, tools[0], user)  # f0 used again: f1 is now the oldest
    facts.shows_tools(render, tools[2], user)  # evicts f1
    n = len(eng.rendered)
    facts.shows_tools(render, tools[0], user)
    assert len(eng.rendered) == n
    facts.shows_tools(render, tools[1], user)
    assert len(eng.rendered) == n + 2


def test_a_template_that_rejects_the_probe_is_judged_on_the_messages():
    """A template that rejects the probe messages: the verdict comes from the request's own
    messages, as before the cache (and the schema section is still added where it drops tools)."""
    plan = ToolPlan("auto", [WEATHER])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    eng = _Counting(shows_tools=False, strict=True)
    assert TemplateFacts().shows_tools(eng.apply_chat_template, [WEATHER], msgs) is None
    text = render_prompt(eng, msgs, plan, facts=TemplateFacts())
    assert text.count('"parameters"') == 1 and text.startswith("<|im_start|>system\nBe brief.")


class _BeforeLastUser(_Counting):
    """A Mistral-style fake: the tools are listed just before the last user message (none without one)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, chat_template_kwargs=None):
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        out = ""
        for i, m in enumerate(messages):
            if tools and users and i == users[-1]:
                out += "[AVAILABLE_TOOLS]" + ",".join(t["function"]["name"] for t in tools) + "[/AVAILABLE_TOOLS]"
            out += f"[{m['role']}]{m.get('content') or ''}"
        return out


@pytest.mark.parametrize("msgs", [[{"role": "system", "content": "You are an agent."},
                                   {"role": "assistant", "content": "I will check."}],
                                  [{"role": "system", "content": "You are an agent."},
                                   {"role": "user", "content": "Weather in Oslo?"}]], ids=["no-user", "user"])
def test_a_template_that_lists_tools_only_before_a_user_message(msgs):
    """Judged on probes of the conversation's shape: without a user message such a template shows
    no tools, so the server's section is added; with one, the template's list is used."""
    plan = ToolPlan("auto", [WEATHER])
    facts = TemplateFacts()
    render_prompt(_BeforeLastUser(False), [{"role": "user", "content": "warm the cache"}], plan, facts=facts)
    text = render_prompt(_BeforeLastUser(False), msgs, plan, facts=facts)
    has_user = any(m["role"] == "user" for m in msgs)
    assert ("[AVAILABLE_TOOLS]get_weather" in text) == has_user and ('"parameters"' in text) != has_user, text


class _ToJson(_Counting):
    """Lists the tools as JSON (``tojson``): names with quotes or backslashes come out escaped."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, chat_template_kwargs=None):
        import json
        head = ("Tools: " + json.dumps([t["function"] for t in tools]) + "\n") if tools else ""
        return head + "".join(f"[{m['role']}]{m.get('content') or ''}" for m in messages)


def test_a_name_the_template_escapes_still_counts_as_shown():
    odd = {"type": "function", "function": {"name": 'ab"c\\d', "parameters": {"type": "object", "properties": {}}}}
    text = render_prompt(_ToJson(False), [{"role": "user", "content": "Hi"}], ToolPlan("auto", [odd]),
                         facts=TemplateFacts())
    assert text.count("Tools: ") == 1 and "# Tools" not in text, text
