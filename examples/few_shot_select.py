"""Few-shot QA with ``select``: a shared few-shot prefix, then the answer is chosen by scoring
each candidate's token logprobs (not sampled). Run: python examples/few_shot_select.py"""
import sglite

SHOTS = [("Is the sun a star?", "yes"), ("Is a whale a fish?", "no"), ("Can penguins fly?", "no"),
         ("Is water wet?", "yes")]
QUESTIONS = ["Is the moon made of cheese?", "Is Paris in France?", "Do cats bark?", "Is ice cold?"]


@sglite.function
def yes_no(s, question):
    for q, a in SHOTS:
        s += "Question: " + q + "\nAnswer: " + a + "\n\n"
    s += "Question: " + question + "\nAnswer: " + sglite.select("answer", choices=["yes", "no"])


def main(engine=None):
    """Answer QUESTIONS with 4-shot select; returns {question: answer}."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        states = yes_no.run_batch([{"question": q} for q in QUESTIONS], backend=engine)
        out = {}
        for q, st in zip(QUESTIONS, states):
            scores = st.get_meta_info("answer")["normalized_prompt_logprobs"]
            out[q] = st["answer"]
            print(f"{q:32s} -> {st['answer']:3s}  (mean logprob yes={scores[0]:.2f}, no={scores[1]:.2f})")
        return out
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
