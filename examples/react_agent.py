"""A ReAct-style agent: the model thinks, picks a tool with ``select``, and writes the tool's
arguments as JSON constrained by the tool's JSON schema; Python runs the tool and the result
goes back as an observation. Run: python examples/react_agent.py

Every step is constrained so that even a 135M model reads well: the thought is one short
sentence (a regex), the action is one of the tools that make sense now or ``finish``
(``select``), the arguments are JSON valid for the tool's schema (a lookup topic is one of the
known topics; a calculator expression is ``a op b`` over numbers seen in the question and the
observations), and the final answer is one of those numbers with an optional unit. One worked
example (earlier chat turns) shows the model the format.
"""
import json
import re

import sglite

FACTS = {"eiffel tower height": "330 metres", "speed of light": "299792 km/s", "mount everest height": "8849 metres"}

THOUGHT = r"I (need|have) [a-zA-Z0-9 ]{3,60}\."   # one short sentence


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


def one_of(numbers) -> str:
    """A regex matching exactly one of ``numbers`` (strings), longest first."""
    return "(" + "|".join(re.escape(n) for n in sorted(set(numbers), key=len, reverse=True)) + ")"


def answer_regex(numbers) -> str:
    """The final answer: one of the numbers seen, and maybe a unit."""
    return one_of(numbers) + "( [a-z/]{1,10})?"


def calculator_schema(numbers) -> dict:
    """Arguments of the calculator: ``a op b`` where a and b are numbers seen in the conversation."""
    num = one_of(numbers)
    return {"type": "object", "properties": {"expression": {"type": "string", "pattern": f"^{num} [-+*/] {num}$"}},
            "required": ["expression"], "additionalProperties": False}


LOOKUP_SCHEMA = {"type": "object", "properties": {"topic": {"enum": list(FACTS)}},
                 "required": ["topic"], "additionalProperties": False}
TOOLS = {"lookup": lookup, "calculator": calculator}


def numbers_in(text: str) -> list:
    return re.findall(r"[0-9]+(?:\.[0-9]+)?", text)


# One worked example, replayed as earlier turns of the chat: (assistant step, observation) pairs.
EXAMPLE_QUESTION = "How high is Mount Everest in metres, times 3?"
EXAMPLE_STEPS = [
    ('Thought: I need the mount everest height.\nAction: lookup\nArguments: {"topic":"mount everest height"}',
     "8849 metres"),
    ('Thought: I need to multiply 8849 by 3.\nAction: calculator\nArguments: {"expression":"8849 * 3"}', "26547"),
    ("Thought: I have the answer.\nAction: finish\nFinal answer: 26547 metres", None),
]


@sglite.function
def agent(s, question, max_steps=3, max_tokens=24):
    s += sglite.system("You answer questions with tools: lookup(topic) finds a fact, calculator(expression) "
                       "does arithmetic. Known topics: " + ", ".join(FACTS) + ".")
    s += sglite.user(EXAMPLE_QUESTION)
    for step, observation in EXAMPLE_STEPS:
        s += sglite.assistant(step)
        if observation is not None:
            s += sglite.user("Observation: " + observation)
    s += sglite.user(question)
    numbers, used = numbers_in(question), []
    for step in range(max_steps):
        # offer the actions that make sense now: each tool once, the calculator after a lookup
        # gave a number, finish after the first observation
        actions = [t for t in TOOLS if t not in used and (t != "calculator" or step > 0)] + (["finish"] if step else [])
        with s.assistant():
            s += "Thought: " + sglite.gen(f"thought{step}", regex=THOUGHT, max_tokens=max_tokens) + "\n"
            s += "Action: " + sglite.select(f"action{step}", choices=actions)
            action = s[f"action{step}"]
            if action == "finish":
                s += "\nFinal answer: " + sglite.gen("answer", regex=answer_regex(numbers), max_tokens=16)
                return
            used.append(action)
            schema = LOOKUP_SCHEMA if action == "lookup" else calculator_schema(numbers)
            s += "\nArguments: " + sglite.gen(f"args{step}", json_schema=schema, max_tokens=48)
        observation = TOOLS[action](**json.loads(s[f"args{step}"]))
        numbers += numbers_in(observation)
        s += sglite.user("Observation: " + observation)
    s += sglite.assistant("Final answer: " + sglite.gen("answer", regex=answer_regex(numbers), max_tokens=16))


def main(engine=None, max_tokens=24):
    """Run the agent on one question; returns the final state's variables."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        st = agent.run(question="How tall is the Eiffel Tower in metres, times 2?", backend=engine,
                       temperature=0, max_tokens=max_tokens)
        if st.error() is not None:
            raise st.error()
        for m in st.messages()[2 + 2 * len(EXAMPLE_STEPS) - 1:]:  # skip the system prompt and the example
            print(f"[{m['role']}] {m['content']}")
        return st.variables()
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
