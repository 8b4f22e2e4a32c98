"""LangGraph (`pip install langgraph langchain-openai`) against `sglite serve`: the prebuilt ReAct
agent with one function tool and a typed output (`response_format`: one more call with a JSON
schema once the agent is done). Start the server first (`sglite serve`), then:

    python examples/agents_langgraph.py [--base-url http://127.0.0.1:30000/v1]

See docs/agents.md for what LangGraph sends.
"""
import argparse
import warnings

from pydantic import BaseModel

# Each model reply's output is capped through ChatOpenAI(max_tokens=...)
# (sent as max_completion_tokens).
# Without a cap the server lets a reply run to the end of the context window (a looping model's
# /v1/responses reply once decoded ~7,000 tokens); a tool call or the typed answer here takes
# well under 200 tokens.
MAX_TOKENS = 1024


class Weather(BaseModel):
    city: str
    summary: str


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"{city}: sunny, 21 C"


def main(base_url: str = "http://127.0.0.1:30000/v1", model: str = None) -> Weather:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    if model is None:
        import openai

        model = openai.OpenAI(base_url=base_url, api_key="sglite").models.list().data[0].id
    llm = ChatOpenAI(model=model, base_url=base_url, api_key="sglite", max_tokens=MAX_TOKENS)
    with warnings.catch_warnings():  # LangGraph 1.x: create_react_agent also lives in langchain.agents
        warnings.simplefilter("ignore")
        agent = create_react_agent(llm, [tool(get_weather)], response_format=Weather)
    out = agent.invoke({"messages": [("user", "What is the weather in Paris?")]}, {"recursion_limit": 8})
    return out["structured_response"]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    print(main(p.parse_args().base_url))
