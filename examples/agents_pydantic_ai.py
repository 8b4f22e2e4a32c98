"""pydantic-ai (`pip install "pydantic-ai-slim[openai]"`) against `sglite serve`: one function tool
and a typed output (pydantic-ai's default ToolOutput: a `final_result` tool). Start the server
first (`sglite serve`), then:

    python examples/agents_pydantic_ai.py [--base-url http://127.0.0.1:30000/v1]

See docs/agents.md for what pydantic-ai sends.
"""
import argparse

from pydantic import BaseModel

# Each model reply's output is capped through pydantic-ai's model setting max_tokens
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
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    if model is None:
        import openai

        model = openai.OpenAI(base_url=base_url, api_key="sglite").models.list().data[0].id
    provider = OpenAIProvider(openai_client=AsyncOpenAI(base_url=base_url, api_key="sglite"))
    agent = Agent(OpenAIChatModel(model, provider=provider), output_type=Weather, tools=[get_weather],
                  model_settings={"max_tokens": MAX_TOKENS},
                  instructions="Call get_weather, then give the final result.")
    return agent.run_sync("What is the weather in Paris?").output


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    print(main(p.parse_args().base_url))
