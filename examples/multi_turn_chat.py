"""A multi-turn chat: each turn's answer stays in the context of the next, and the whole
conversation (with the template's default system prompt) is in ``state.messages()``.
Run: python examples/multi_turn_chat.py"""
import sglite


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
        turns = ["Hi! What is a good name for a cat?", "Why that name?", "Give one more name."]
        st = chat.run(turns=turns, backend=engine, temperature=0, max_tokens=max_tokens, stream=True)
        for chunk in st.text_iter():
            print(chunk, end="", flush=True)
        print()
        for m in st.messages():
            print(f"[{m['role']}] {m['content'][:80]}")
        return st.messages()
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
