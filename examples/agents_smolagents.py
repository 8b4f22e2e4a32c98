"""smolagents (`pip install "smolagents[openai]"`) against `sglite serve`: a ToolCallingAgent with
one function tool; its typed output is the `final_answer` tool's argument (a string). Start the
server first (`sglite serve`), then:

    python examples/agents_smolagents.py [--base-url http://127.0.0.1:30000/v1]

See docs/agents.md for what smolagents sends (every step forces a tool call).
"""
import argparse

# Each model reply's output is capped through OpenAIServerModel's extra keyword
# max_tokens, which smolagents passes on to every chat-completions request.
# Without a cap the server lets a reply run to the end of the context window (a looping model's
# /v1/responses reply once decoded ~7,000 tokens); a tool call or the typed answer here takes
# well under 200 tokens.
MAX_TOKENS = 1024


def get_weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: the city's name
    """
    return f"{city}: sunny, 21 C"


def main(base_url: str = "http://127.0.0.1:30000/v1", model: str = None, max_steps: int = 4) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    if model is None:
        import openai

        model = openai.OpenAI(base_url=base_url, api_key="sglite").models.list().data[0].id
    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key="sglite", max_tokens=MAX_TOKENS)
    agent = ToolCallingAgent(tools=[tool(get_weather)], model=llm, max_steps=max_steps, verbosity_level=0)
    return str(agent.run("What is the weather in Paris?"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    print(main(p.parse_args().base_url))
