"""Parallel programs with ``run_batch``: each review is classified with ``select`` and
summarised with a regex-constrained ``gen`` (a few words); programs run concurrently and the engine batches their requests.
The instruction prefix every program shares is prefilled once before the batch fans out.
Run: python examples/parallel_batch.py"""
import time

import sglite

REVIEWS = ["The battery lasts all day and the screen is gorgeous.", "Broke after two days. Waste of money.",
           "It works, nothing special.", "Absolutely love it, best purchase this year!",
           "The delivery was late and the box was damaged.", "Decent value for the price.",
           "Terrible customer service, never again.", "Sleek design and very fast."]
SUMMARY = r"[A-Z][a-z]+( [a-z']+){1,8}\."  # a few words, one sentence


@sglite.function
def review(s, text, max_tokens=16):
    s += sglite.system("You are a careful product-review analyst. You read one customer review, decide whether "
                       "its sentiment is positive, negative or neutral, and summarise it in a few words.")
    s += sglite.user("Review: " + text)
    with s.assistant():
        s += "Sentiment: " + sglite.select("sentiment", choices=["positive", "negative", "neutral"]) + "\n"
        s += "Summary: " + sglite.gen("summary", max_tokens=max_tokens, regex=SUMMARY)


def main(engine=None, max_tokens=16):
    """Classify REVIEWS in one batch; returns [(sentiment, summary)]."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        t0 = time.perf_counter()
        states = review.run_batch([{"text": r, "max_tokens": max_tokens} for r in REVIEWS], backend=engine,
                                  temperature=0, progress_bar=True)
        dt = time.perf_counter() - t0
        out = [(st["sentiment"], st["summary"]) for st in states]
        for r, (sent, summ) in zip(REVIEWS, out):
            print(f"{sent:8s} | {r[:40]:40s} | {summ}")
        print(f"{len(REVIEWS)} programs in {dt:.1f} s")
        return out
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
