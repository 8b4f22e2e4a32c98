"""Model evaluation: perplexity over a fixed local text (``sglite eval perplexity``)."""
