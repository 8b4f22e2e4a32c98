"""Prompts shared by the speculative-decoding test files: copy-heavy prompts (n-gram drafts find
their continuations in the prompt) and a source paragraph to copy into JSON (text drafts)."""

COPY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "alpha beta gamma delta alpha beta gamma delta alpha beta",
    "1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3",
    "Write something new about the sea.",
]

SOURCE = ("Maria Gonzalez lives in Seville and works as a veterinarian. You can reach Maria at "
          "maria.gonzalez@example.com. Extract the name, email, city and job of this person as JSON.")
