"""The OpenAI Agents SDK (`pip install openai-agents`) against `sglite serve`: one function tool,
a typed output, with either of the SDK's models: the Responses API one (the SDK's default) or the
chat-completions one. Start the server first (`sglite serve`), then:

    python examples/agents_openai_agents.py [--api responses|chat] [--base-url http://127.0.0.1:30000/v1]

See docs/agents.md for what the SDK sends and the server flags that matter.
"""
import argparse

from pydantic import BaseModel

# Each model reply's output is capped through the SDK's ModelSettings(max_tokens=...),
# sent as max_output_tokens on /v1/responses and max_tokens on /v1/chat/completions.
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


def main(base_url: str = "http://127.0.0.1:30000/v1", api: str = "responses", model: str = None) -> Weather:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces go to OpenAI's servers otherwise
    client = AsyncOpenAI(base_url=base_url, api_key="sglite")
    if model is None:
        import openai

        model = openai.OpenAI(base_url=base_url, api_key="sglite").models.list().data[0].id
    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions="Call get_weather, then answer with the city and a short summary.",
                  tools=[function_tool(get_weather)], output_type=Weather,
                  model=model_cls(model=model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS))
    return Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4).final_output


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    p.add_argument("--api", choices=("responses", "chat"), default="responses")
    a = p.parse_args()
    print(main(a.base_url, a.api))
