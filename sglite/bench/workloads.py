"""Benchmark workloads, generated locally from a seed (nothing is downloaded).

The families mirror the SGLang paper's evaluation (Zheng et al., 2024, §6): independent
requests, few-shot prompts that share a long prefix, multi-turn chat that resends its history,
JSON decoding under a schema, and agent programs.

A workload is a list of :class:`Session`; a session is one or more :class:`Turn` sent one after
the other (only ``multi-turn`` has several: each turn's prompt is the conversation so far,
including the model's real earlier replies, plus the new user message). Session arrival times
come from the serving driver (Poisson at ``--request-rate``).

Text is built from a fixed list of common English words; in byte-level BPE vocabularies such as
SmolLM2's, ``" word"`` is one token, so a length in *words* is close to one in tokens. The
server reports the exact token counts, and those are what the statistics use.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Optional

WORDS = (
    "the of and to in is was for that on as with by he at from his it an were are which this be "
    "or has had not first one their its new after but who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "team american since while under three film well game season both part year south between "
    "north people river also life each house including found high number following work group "
    "name became due early based along around area best long small great water light music "
    "market report simple question answer model paper table field value result system order").split()

DATASETS = ("random", "shared-prefix", "multi-turn", "json", "agent", "sharegpt")


@dataclass(frozen=True)
class Turn:
    """One request of a session: ``text`` (the prompt, or for chat the new user message),
    ``output_len`` (max new tokens) and ``extra`` sampling parameters (e.g. ``json_schema``)."""

    text: str
    output_len: int
    extra: dict = field(default_factory=dict)
    ignore_eos: bool = True


@dataclass(frozen=True)
class Session:
    """Turns sent in order; with ``chat`` each prompt is the history plus the new turn."""

    turns: tuple
    chat: bool = False


@dataclass(frozen=True)
class WorkloadOptions:
    """Sizes of the generated workloads (lengths in words ≈ tokens).

    random: input/output lengths uniform in ``[len·range_ratio, len]`` (SGLang's meaning; 1 = fixed).
    shared-prefix: ``num_groups`` system prompts of ``system_len`` words, each followed by
    questions of ``question_len`` words; ``output_len`` new tokens.
    multi-turn: ``num_turns`` turns per conversation, user messages of ``turn_len`` words,
    ``output_len`` new tokens per reply.
    json: ``output_len`` is the token cap; the schema makes the model stop.
    """

    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 1.0
    num_groups: int = 4
    system_len: int = 512
    question_len: int = 32
    num_turns: int = 4
    turn_len: int = 48

    def __post_init__(self):
        for name in ("input_len", "output_len", "num_groups", "system_len", "question_len", "num_turns",
                     "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.range_ratio <= 1:
            raise ValueError(f"range_ratio: must be in [0, 1], got {self.range_ratio}")


def random_words(rng: random.Random, n: int) -> str:
    """``n`` words drawn from :data:`WORDS`, joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _length(rng: random.Random, full: int, ratio: float) -> int:
    return rng.randint(max(1, int(full * ratio)), full)


def random_workload(n: int, rng: random.Random, o: WorkloadOptions) -> list[Session]:
    """Independent prompts of random words; no prefix reuse beyond chance."""
    return [Session((Turn(random_words(rng, _length(rng, o.input_len, o.range_ratio)),
                          _length(rng, o.output_len, o.range_ratio)),)) for _ in range(n)]


def shared_prefix_workload(n: int, rng: random.Random, o: WorkloadOptions) -> list[Session]:
    """``num_groups`` long system prompts (few-shot style); each request is one group's prompt
    plus a distinct question. Requests of all groups are shuffled together."""
    systems = [f"You are assistant number {g}. Study these examples carefully.\n" + random_words(rng, o.system_len)
               for g in range(o.num_groups)]
    out = [Session((Turn(systems[i % o.num_groups] + f"\nQuestion {i}: " + random_words(rng, o.question_len)
                         + "\nAnswer:", o.output_len),)) for i in range(n)]
    rng.shuffle(out)
    return out


def multi_turn_workload(n: int, rng: random.Random, o: WorkloadOptions) -> list[Session]:
    """``n`` conversations of ``num_turns`` turns; each turn resends the history (``chat=True``)."""
    return [Session(tuple(Turn(random_words(rng, o.turn_len), o.output_len) for _ in range(o.num_turns)),
                    chat=True) for _ in range(n)]


_FIELD_TYPES = ({"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 1000},
                {"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]})
_NOUNS = ("person", "product", "city", "book", "event", "company", "planet", "recipe")
_KEYS = ("name", "age", "title", "country", "price", "rating", "category", "color", "year", "author",
         "active", "priority", "population", "weight", "status", "language")


def json_schema_for(rng: random.Random) -> dict:
    """A small flat object schema (3–6 required properties of mixed types)."""
    keys = rng.sample(_KEYS, rng.randint(3, 6))
    props = {k: dict(rng.choice(_FIELD_TYPES)) for k in keys}
    return {"type": "object", "properties": props, "required": keys, "additionalProperties": False}


def json_workload(n: int, rng: random.Random, o: WorkloadOptions) -> list[Session]:
    """Prompts asking for a JSON description of a thing, each with its own ``json_schema``."""
    out = []
    for i in range(n):
        schema = json_schema_for(rng)
        noun = rng.choice(_NOUNS)
        text = (f"Describe a fictional {noun} ({random_words(rng, 8)}) as a JSON object with the fields "
                f"{', '.join(schema['required'])}.\nJSON:")
        out.append(Session((Turn(text, o.output_len, {"json_schema": json.dumps(schema)}, ignore_eos=False),)))
    return out


_BUILDERS = {"random": random_workload, "shared-prefix": shared_prefix_workload,
             "multi-turn": multi_turn_workload, "json": json_workload}


def build_workload(name: str, num_prompts: int, seed: int = 0,
                   options: Optional[WorkloadOptions] = None) -> list[Session]:
    """Generate ``num_prompts`` sessions of workload ``name`` from ``seed`` (deterministic).

    For ``multi-turn`` a session is a conversation (``num_turns`` requests).
    Raises:
        ValueError: unknown ``name`` (lists the known ones; ``agent`` is built by
            :func:`agent_arguments`) or ``num_prompts`` < 1.
    """
    if name == "sharegpt":
        raise ValueError("dataset: sharegpt is read from a file (--dataset-path): use sharegpt_workload")
    if name not in _BUILDERS:
        raise ValueError(f"dataset: unknown workload {name!r}; known: {sorted(_BUILDERS)} (and 'agent', 'sharegpt')")
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    return _BUILDERS[name](num_prompts, random.Random(seed), options or WorkloadOptions())


# ---------------------------------------------------------------------------------- ShareGPT
SHAREGPT_CONTEXT_LEN = 2048   # prompt + output tokens above this are "too long" (vLLM's / SGLang's limit)
SHAREGPT_MIN_LEN = 2          # prompts or outputs below this many tokens are "too short"


def load_sharegpt(path) -> list[tuple[str, str]]:
    """``(prompt, reply)`` text pairs of a ShareGPT-format JSON file.

    The file is a JSON list of ``{"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}``; per conversation the first ``human`` turn is the
    prompt and the first ``gpt`` turn after it the reply. Conversations without such a pair
    are skipped (as SGLang skips those with fewer than two turns).

    Raises:
        ValueError: naming ``--dataset-path`` when the file is missing or unreadable, is not
            JSON, is not a list of objects with a ``conversations`` list, or holds no pair.
    """
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset-path: no such file: {str(p)!r}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path: {str(p)!r} is not a readable JSON file: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path: {str(p)!r} must hold a JSON list of conversations, "
                         f"got {type(data).__name__}")
    pairs = []
    for i, item in enumerate(data):
        conv = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(conv, list):
            raise ValueError(f"--dataset-path: entry {i} of {str(p)!r} has no 'conversations' list")
        turns = [(t.get("from"), t.get("value")) for t in conv if isinstance(t, dict)]
        human = next((k for k, (who, v) in enumerate(turns) if who == "human" and isinstance(v, str)), None)
        if human is None:
            continue
        reply = next((v for who, v in turns[human + 1:] if who == "gpt" and isinstance(v, str)), None)
        if reply is not None:
            pairs.append((turns[human][1], reply))
    if not pairs:
        raise ValueError(f"--dataset-path: {str(p)!r} has no conversation with a human turn followed by a gpt turn")
    return pairs


def sharegpt_workload(pairs: list[tuple[str, str]], num_prompts: int, encode, seed: int = 0,
                      output_len: Optional[int] = None,
                      context_len: int = SHAREGPT_CONTEXT_LEN) -> list[Session]:
    """Up to ``num_prompts`` single-turn sessions sampled from ShareGPT ``pairs`` (see :func:`load_sharegpt`).

    As SGLang's ``sample_sharegpt_requests``: the pairs are shuffled with ``seed``; each prompt is
    sent as is and asks for as many new tokens as the reply has (``len(encode(reply))``, or
    ``output_len`` when given); pairs whose prompt or output is under 2 tokens (too short) or
    whose prompt + output exceed ``context_len`` tokens (too long) are skipped.

    Args:
        encode: text → token ids (the served model's tokenizer).
    Returns:
        The sessions; fewer than ``num_prompts`` when the file has too few usable pairs.
    Raises:
        ValueError: ``num_prompts`` < 1, ``output_len`` < 1 or ``context_len`` < 2, or no pair
            passes the length filter (naming ``--dataset-path``).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"sharegpt_output_len: must be >= 1, got {output_len}")
    if context_len < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"sharegpt_context_len: must be >= {2 * SHAREGPT_MIN_LEN}, got {context_len}")
    order = list(pairs)
    random.Random(seed).shuffle(order)
    out = []
    for prompt, reply in order:
        if len(out) == num_prompts:
            break
        n_in = len(encode(prompt))
        n_out = output_len if output_len is not None else len(encode(reply))
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN or n_in + n_out > context_len:
            continue
        out.append(Session((Turn(prompt, n_out),)))
    if not out:
        raise ValueError(f"--dataset-path: none of the {len(pairs)} conversations has a prompt and reply of "
                         f">= {SHAREGPT_MIN_LEN} tokens with prompt + reply <= {context_len} tokens")
    return out


# ---------------------------------------------------------------------------------- agent
AGENT_TOOLS = ("search", "lookup", "calculate", "finish")


def agent_system_prompt(rng: random.Random, length: int) -> str:
    """The agent's shared instructions: tool descriptions plus a few-shot trace of ~``length`` words."""
    tools = "\n".join(f"- {t}[input]: {random_words(rng, 12)}" for t in AGENT_TOOLS)
    return ("Solve the question by interleaving Thought, Action and Observation steps.\nTools:\n" + tools
            + "\nExample:\n" + random_words(rng, length) + "\n")


def agent_arguments(n: int, seed: int = 0, steps: int = 2, system_len: int = 256) -> list[dict]:
    """Arguments of :func:`agent_program` for ``n`` programs (same system prompt, distinct questions)."""
    rng = random.Random(seed)
    system = agent_system_prompt(rng, system_len)
    return [{"system": system, "question": random_words(rng, 16),
             "observations": [random_words(rng, 20) for _ in range(steps)]} for _ in range(n)]


def agent_program(thought_len: int = 24, answer_len: int = 16):
    """A ReAct-style ``@function`` (Yao et al., 2023): per step a free ``gen`` thought, a
    ``select`` over :data:`AGENT_TOOLS`, a ``gen`` tool input, and a canned observation; then an
    answer. Call with the dicts of :func:`agent_arguments`."""
    from sglite.frontend import function, gen, select

    @function
    def react_agent(s, system, question, observations):
        s += system + "Question: " + question + "\n"
        for i, obs in enumerate(observations):
            s += f"Thought {i + 1}:" + gen(f"thought_{i}", max_tokens=thought_len, stop="\n") + "\n"
            s += f"Action {i + 1}: " + select(f"action_{i}", choices=list(AGENT_TOOLS))
            s += "[" + gen(f"input_{i}", max_tokens=8, stop="]") + "]\n"
            s += f"Observation {i + 1}: {obs}\n"
        s += "Answer:" + gen("answer", max_tokens=answer_len, stop="\n")

    return react_agent


def with_adapters(sessions: list, names) -> list:
    """``sessions`` with session ``i``'s turns sent to LoRA adapter ``names[i % len(names)]``
    (``lora_path`` of the native API, the ``model`` of the OpenAI one; ``sglite bench serving
    --lora-names``); unchanged when ``names`` is empty."""
    if not names:
        return list(sessions)
    from dataclasses import replace

    return [replace(s, turns=[replace(t, extra={**t.extra, "lora_path": names[i % len(names)]}) for t in s.turns])
            for i, s in enumerate(sessions)]
