"""A multi-turn chat, streamed: each turn's answer stays in the context of the next, each
answer is printed as it is generated (``text_iter(var)`` on a ``stream=True`` run), and the whole
conversation (with the template's default system prompt) is in ``state.messages()``.
Run: python examples/multi_turn_chat.py"""
import sglite

TURNS = ["Suggest a name for a black cat. Answer in one sentence.", "Why is that a good name?",
         "Now suggest a name for a white cat, in one sentence."]


@sglite.function
def chat(s, turns, max_tokens=48):
    for i, q in enumerate(turns):
        s += sglite.user(q)
        s += sglite.assistant(sglite.gen(f"answer{i}", max_tokens=max_tokens))


def main(engine=None, max_tokens=48):
    """Three turns, streamed; returns the messages."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        st = chat.run(turns=TURNS, backend=engine, temperature=0, max_tokens=max_tokens, stream=True)
        for i, q in enumerate(TURNS):
            print(f"[user] {q}\n[assistant] ", end="", flush=True)
            for chunk in st.text_iter(f"answer{i}"):
                print(chunk, end="", flush=True)
            print()
        msgs = st.messages()
        print(f"({len(msgs)} messages; the first is the template's system prompt: {msgs[0]['content']!r})")
        return msgs
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
