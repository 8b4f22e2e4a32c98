"""Speculative decoding (issue 29): exact seeds.

A seeded sampled request gives the same output whatever was drafted and however long the verify
steps were: each verify row's target token is the plain sampler's ``(seed, output position)``
draw, so the output is also the plain engine's output for that seed.

Oracles: ``kernels.sample``'s own draws (unit), the plain engine's seeded output (end to end),
under proposers that draft differently on every run (random lengths, random tokens, random trees).
"""
import random

import pytest
import torch

from sglite import Engine, kernels
from sglite.runtime.speculative.proposer import EntryProposer
from sglite.runtime.speculative.tree import TreeDraft, verify_tree
from sglite.runtime.speculative.verify import Draws, verify_chain
from sglite.sampling_params import SamplingParams
from tests.speculative.prompts import COPY_PROMPTS


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/speculative/conftest.py

ROWS = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)) * 1.5  # [k+1, V]


def _plain(x, params, seed, start):
    """The plain sampler's token at each row (row i at output position start + i)."""
    n = x.shape[0]
    f = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return kernels.sample(x, f(params.temperature, torch.float32), f(params.top_p, torch.float32),
                          f(params.top_k, torch.int64), f(params.min_p, torch.float32), f(seed, torch.int64),
                          torch.arange(start, start + n)).tolist()


@pytest.mark.parametrize("temp,top_k,top_p", [(0.8, 0, 1.0), (1.3, 6, 0.9)])
def test_verified_tokens_are_the_plain_samplers_draws_whatever_the_draft(temp, top_k, top_p):
    params = SamplingParams(max_new_tokens=8, temperature=temp, top_k=top_k, top_p=top_p)
    rng = random.Random(0)
    for seed in range(40):
        want = _plain(ROWS, params, seed, 11)
        for _ in range(4):  # drafts: the plain draws with random mistakes, random lengths
            k = rng.randint(0, 5)
            draft = [t if rng.random() < 0.7 else rng.randrange(16) for t in want[:k]]
            toks, a = verify_chain(ROWS[:k + 1], draft, params, Draws(seed, 11))
            assert toks == want[:a + 1]
            assert a == next((i for i in range(k) if draft[i] != want[i]), k)


def test_tree_verification_follows_the_plain_draws():
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    x = ROWS[:5]  # root, chain 0 (2 nodes), chain 1 (2 nodes)
    for seed in range(60):
        root = _plain(x[:1], params, seed, 4)[0]
        tree = TreeDraft([[root ^ 1, 3], [root, 5]]) if seed % 2 else TreeDraft([[root, 2], [root ^ 1, 7]])
        toks, a, chain = verify_tree(x, tree, params, Draws(seed, 4))
        assert toks[0] == root and chain == (1 if seed % 2 else 0) and a >= 1
        row = 1 + (2 if seed % 2 else 0)  # the node under the root spelling `root`
        second = _plain(x[row:row + 1], params, seed, 5)[0]  # the plain draw after `root`
        assert toks[1] == second and a == (2 if tree.chains[chain][1] == second else 1)


def test_sampled_verification_needs_draws():
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match="draws"):
        verify_chain(ROWS[:3], [1, 2], params)


# ---------------------------------------------------------------------- end to end
def _random_proposer(rng: random.Random, vocab: int, continuation: dict):
    """Drafts that change on every call: 0-5 tokens, the plain continuation with random mistakes
    or random tokens, sometimes a second chain (a token tree)."""
    def fn(e):
        r = e.req
        want = next((v for ids, v in continuation.items() if tuple(r.input_ids[-len(ids):]) == ids), [])
        n = len(r.output_ids)
        k = rng.randint(0, 5)
        chain = [t if rng.random() < 0.75 else rng.randrange(vocab) for t in want[n:n + k]]
        chains = [(chain, ["text"] * len(chain))] if chain else []
        if chain and rng.random() < 0.3:
            other = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            if other[0] != chain[0]:
                chains.append((other, ["text"] * len(other)))
        return chains
    return fn


KW = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True)
SP = [{"max_new_tokens": 20, "temperature": 0.8, "sampling_seed": 1234},
      {"max_new_tokens": 20, "temperature": 1.1, "top_k": 20, "top_p": 0.9, "sampling_seed": 7,
       "frequency_penalty": 0.5, "presence_penalty": 0.3},
      {"max_new_tokens": 20, "temperature": 0.7, "min_p": 0.05, "sampling_seed": 2**40 + 5, "repetition_penalty": 1.2}]


def test_seeded_output_is_the_plain_output_whatever_the_policy(tiny_model_dir):
    """NGRAM with a proposer that drafts at random (lengths, tokens, trees): three runs of the
    same seeded requests (penalties, top-k/p, min-p) give one output, the plain engine's."""
    prompts = COPY_PROMPTS[:3]
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = [o["output_ids"] for o in base.generate(prompts, SP)]
        ids = [tuple(base.tokenizer.encode(p)) for p in prompts]
    finally:
        base.shutdown()
    cont = {i: w for i, w in zip(ids, want)}  # drafts near the seeded output: many are kept
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64, **KW)
    try:
        vocab = spec.scheduler.sampler.vocab_size
        for run in range(3):
            spec.scheduler.spec.proposer = EntryProposer(_random_proposer(random.Random(run), vocab, cont))
            got = [o["output_ids"] for o in spec.generate(prompts, SP)]
            assert got == want, run
        st = spec.get_server_info()
        assert st["spec_accepted_tokens"] > 20 and st["spec_tree_steps"] > 0, st
        assert st["spec_draft_tokens"] > st["spec_accepted_tokens"]  # rejections happened too
    finally:
        spec.shutdown()


def test_seeded_output_with_n_and_stop_strings_matches_plain(tiny_model_dir):
    """n > 1 (each choice its own seed stream) and a stop string, with NGRAM's own drafts."""
    prompt = COPY_PROMPTS[0]
    sp = {"max_new_tokens": 24, "temperature": 0.9, "sampling_seed": 99, "n": 3}
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = base.generate(prompt, sp)
        text = want[0]["text"]
        stop = text[len(text) // 2:len(text) // 2 + 3] if len(text) > 8 else None
        sp_stop = dict(sp, stop=[stop]) if stop and stop.strip() else sp
        want_stop = base.generate(prompt, sp_stop)
    finally:
        base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64,
                  speculative_num_draft_tokens=4, **KW)
    try:
        for _ in range(2):
            assert [o["output_ids"] for o in spec.generate(prompt, sp)] == [o["output_ids"] for o in want]
            got = spec.generate(prompt, sp_stop)
            assert [o["text"] for o in got] == [o["text"] for o in want_stop]
    finally:
        spec.shutdown()


def test_standalone_seeded_output_matches_plain(tiny_model_dir):
    """STANDALONE (self-speculation, different draft lengths per engine) equals the plain output."""
    prompts = COPY_PROMPTS[:2]
    sp = SP[:2]
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = [o["output_ids"] for o in base.generate(prompts, sp)]
    finally:
        base.shutdown()
    for steps in (2, 5):
        e = Engine(str(tiny_model_dir), speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=str(tiny_model_dir), speculative_num_steps=steps, **KW)
        try:
            got = e.generate(prompts, sp)
            assert [o["output_ids"] for o in got] == want, steps
            assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0
        finally:
            e.shutdown()


def test_seeded_grammar_requests_match_plain(tiny_model_dir):
    """Sampled requests under a JSON Schema, a regex with forced text and EBNF: the grammar masks
    every verify row and forced (jump-forward) tokens ride in the drafts; the seeded output is the
    plain engine's, with random drafts and with NGRAM's own."""
    from tests.speculative.test_grammar_draft_edges import GRAMMARS, PROMPTS

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    sps = [{"max_new_tokens": 40, "temperature": 0.9, "sampling_seed": 11 + i, **GRAMMARS[g]}
           for i, g in enumerate(("schema", "ends_forced", "ebnf"))]
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = [o["output_ids"] for o in base.generate(prompts, sps)]
        ids = [tuple(base.tokenizer.encode(p)) for p in prompts]
    finally:
        base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64, **KW)
    try:
        assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want  # NGRAM's own drafts
        vocab = spec.scheduler.sampler.vocab_size
        for run in range(2):  # one request per prompt text: the random proposer keys on the prompt
            for p, sp, w, i in zip(prompts, sps, want, ids):
                spec.scheduler.spec.proposer = EntryProposer(_random_proposer(random.Random(run), vocab, {i: w}))
                assert spec.generate(p, sp)["output_ids"] == w, (run, sp)
        assert spec.get_server_info()["spec_forced_tokens"] > 0
    finally:
        spec.shutdown()
