"""The cases of ``benchmarks/client_compat.py``: one ``(client, name, fn)`` per protocol feature a
third-party OpenAI client exercises against ``sglite serve`` (structured output, tools, streaming,
logprobs, ...). Like the runner, this module does not import sglite: it runs in the clients' own
virtual environment."""
from __future__ import annotations

import json
from typing import List

MAX_TOKENS = 200


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
