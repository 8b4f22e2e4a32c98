"""Few-shot classification with ``select``: a shared few-shot prefix, then the answer is chosen
by scoring each candidate's token logprobs (not sampled), so it is always one of the classes.
Run: python examples/few_shot_select.py"""
import sglite

CLASSES = ["mammal", "bird", "fish"]
SHOTS = [("dog", "mammal"), ("eagle", "bird"), ("salmon", "fish"), ("cow", "mammal"), ("parrot", "bird"),
         ("shark", "fish")]
QUESTIONS = ["cat", "sparrow", "tuna", "whale", "penguin", "trout"]  # whale and penguin are the tricky ones


@sglite.function
def classify(s, animal):
    for a, c in SHOTS:
        s += "Animal: " + a + "\nClass: " + c + "\n\n"
    s += "Animal: " + animal + "\nClass: " + sglite.select("answer", choices=CLASSES)


def main(engine=None):
    """Classify QUESTIONS with 6-shot select (one batch; the shots are prefilled once); returns {animal: class}."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        states = classify.run_batch([{"animal": q} for q in QUESTIONS], backend=engine)
        out = {}
        for q, st in zip(QUESTIONS, states):
            scores = st.get_meta_info("answer")["normalized_prompt_logprobs"]
            out[q] = st["answer"]
            detail = ", ".join(f"{c}={lp:.2f}" for c, lp in zip(CLASSES, scores))
            print(f"{q:8s} -> {st['answer']:6s}  (mean token logprob: {detail})")
        return out
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
