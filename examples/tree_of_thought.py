"""Tree of thought with ``fork``: three branches propose approaches in parallel from one shared
(prefilled-once) prefix, then the parent picks the best with ``select``.
Run: python examples/tree_of_thought.py"""
import sglite
IDEA = r"[A-Z][a-z]+( [a-z]+){2,12}\."  # one sentence of words


@sglite.function
def tree_of_thought(s, problem, width=3, max_tokens=32):
    s += sglite.user("Problem: " + problem + "\nPropose one short approach.")
    with s.assistant():
        forks = s.fork(width)
        forks += lambda i: f"Approach {i + 1}: " + sglite.gen("approach", max_tokens=max_tokens, regex=IDEA,
                                                              temperature=0.8, top_p=0.95)
        forks.join()
    approaches = s["approach"]
    s += sglite.user("Approaches:\n" + "\n".join(f"{i + 1}. {a}" for i, a in enumerate(approaches))
                     + "\nWhich approach is best? Reply with its number.")
    s += sglite.assistant(sglite.select("best", choices=[str(i + 1) for i in range(width)]))


def main(engine=None, max_tokens=32):
    """Solve one problem; returns (approaches, best index string, cached tokens per branch)."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        st = tree_of_thought.run(problem="How can a small town reduce traffic jams?", backend=engine,
                                 max_tokens=max_tokens)
        for i, a in enumerate(st["approach"]):
            print(f"{i + 1}. {a}")
        cached = [m["cached_tokens"] for m in st.get_meta_info("approach")]
        print("best:", st["best"], "| cached prompt tokens per branch:", cached)
        return st["approach"], st["best"], cached
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
