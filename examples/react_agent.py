"""A ReAct-style agent: the model thinks, picks a tool with ``select``, and writes the tool's
arguments as JSON constrained by the tool's JSON schema; Python runs the tool and the result
goes back as an observation. Run: python examples/react_agent.py"""
import json

import sglite

FACTS = {"eiffel tower height": "330 metres", "speed of light": "299,792 km/s", "mount everest": "8,849 metres"}


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers only (no names, no calls)."""
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only numbers and + - * / ( ) are allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - input filtered above
    except Exception as e:  # noqa: BLE001 - the error text is the observation
        return f"error: {e}"


def lookup(topic: str) -> str:
    """Look a topic up in a tiny fact table."""
    return FACTS.get(topic.lower().strip(), "no entry; known topics: " + ", ".join(FACTS))


TOOLS = {
    "calculator": (calculator, {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 40}},
                                "required": ["expression"], "additionalProperties": False}),
    "lookup": (lookup, {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 30}},
                        "required": ["topic"], "additionalProperties": False}),
}


@sglite.function
def agent(s, question, max_steps=3, max_tokens=24):
    s += sglite.system("You solve tasks with tools. Tools: calculator(expression), lookup(topic). "
                       "Topics: " + ", ".join(FACTS) + ".")
    s += sglite.user(question)
    for step in range(max_steps):
        with s.assistant():
            s += "Thought: " + sglite.gen(f"thought{step}", max_tokens=max_tokens, stop="\n") + "\n"
            s += "Action: " + sglite.select(f"action{step}", choices=["calculator", "lookup", "finish"])
        action = s[f"action{step}"]
        if action == "finish":
            break
        tool, schema = TOOLS[action]
        with s.assistant():
            s += "Arguments: " + sglite.gen(f"args{step}", json_schema=schema, max_tokens=64)
        args = json.loads(s[f"args{step}"])
        s += sglite.user("Observation: " + tool(**args))
    s += sglite.assistant("Final answer: " + sglite.gen("answer", max_tokens=max_tokens, stop="\n"))


def main(engine=None, max_tokens=24):
    """Run the agent on one question; returns the final state's variables."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        st = agent.run(question="How tall is the Eiffel Tower in metres, times 2?", backend=engine,
                       temperature=0, max_tokens=max_tokens)
        for m in st.messages():
            print(f"[{m['role']}] {m['content']}")
        return st.variables()
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
