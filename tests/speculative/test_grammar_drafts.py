"""Speculative decoding (issue 17): drafts under a grammar. A draft token the grammar forbids ends
the draft; greedy verification walks the grammar lazily (no per-draft masks); jump-forward text
rides along as free, always-accepted drafts; and drafts close a copied JSON string value at a word
boundary.

Oracles: the grammar's own forced text (the tokens the plain run's jump-forward appends),
verification rules worked by hand (a forced draft token is kept whatever the logits say, and
only behind a kept token), prefix matching against fully masked rows for the lazy walk, and greedy
output token for token against the engine without speculation, with drafts taken from that very
output (an oracle drafter: every draft token the model will agree with, so forced text is verified
inside the chains).
"""
import json

import pytest
import torch

from sglite.runtime.speculative.grammar_walk import CLOSE, FORCED, whole_forced
from sglite.runtime.speculative.tree import TreeDraft, verify_tree
from sglite.runtime.speculative.verify import Draws, greedy_walk, verify_chain
from sglite.testing import oracle_drafts

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40}}}


class _Params:
    temperature, top_k, top_p, min_p = 1.0, -1, 1.0, 0.0


def _rows(argmax: list[int], vocab: int = 12) -> torch.Tensor:
    x = torch.zeros(len(argmax), vocab)
    for i, t in enumerate(argmax):
        x[i, t] = 10.0
    return x


# ---------------------------------------------------------------------- verification (unit)
def test_forced_draft_tokens_are_kept_whatever_the_logits():
    # greedy: the row before draft[1] predicts 9, but draft[1] is forced text: kept
    toks, a = verify_chain(_rows([3, 9, 5, 7]), [3, 4, 5], type("G", (), {"temperature": 0.0}), forced={1})
    assert (toks, a) == ([3, 4, 5, 7], 3)
    # ... but only behind a kept token: draft[0] refused, the forced one is never reached
    toks, a = verify_chain(_rows([8, 9, 5, 7]), [3, 4, 5], type("G", (), {"temperature": 0.0}), forced={1})
    assert (toks, a) == ([8], 0)
    # sampling: the target gives the forced token probability ~0, it is still kept
    x = _rows([3, 9, 5, 7]) * 10
    toks, a = verify_chain(x, [3, 4, 5], _Params(), Draws(0, 0), forced={1})
    assert toks[:3] == [3, 4, 5] and a == 3


def test_forced_nodes_in_a_token_tree_and_the_greedy_grammar_walk():
    tree = TreeDraft([[1, 2, 3], [4, 5]])
    # rows: root, then chain 0 nodes (1, 2, 3), then chain 1 nodes (4, 5)
    x = _rows([4, 0, 0, 0, 9, 6])
    toks, a, chain = verify_tree(x, tree, type("G", (), {"temperature": 0.0}), forced=[set(), {1}])
    assert (toks, a, chain) == ([4, 5, 6], 2, 1)  # 5 is forced after 4: kept though row 4 says 9

    class Free:  # a grammar that allows everything
        def __init__(self):
            self.n = 0

        def is_terminated(self):
            return False

        def accept_token(self, t):
            self.n += 1
            return True

        def rollback(self, k):
            self.n -= k

    g = Free()
    draft = [3, 4, 5]
    child = lambda row, t: row + 1 if row < len(draft) and draft[row] == t else None  # noqa: E731
    toks, rows = greedy_walk(_rows([3, 9, 5, 7]), child, g, 1, forced=lambda row: draft[row] if row == 1 else None)
    assert toks == [3, 4, 5, 7] and rows == [0, 1, 2, 3] and g.n == 0


def test_whole_forced_keeps_the_closing_token_with_its_text():
    srcs = ["text", "text", CLOSE, FORCED, FORCED]
    assert [whole_forced(srcs, n, up=True) for n in range(6)] == [0, 1, 2, 5, 5, 5]
    assert [whole_forced(srcs, n, up=False) for n in range(6)] == [0, 1, 2, 2, 2, 5]
    assert whole_forced(["text"] * 3, 2, up=True) == 2  # no forced tail: unchanged


def test_rows_before_forced_text_skip_the_lm_head():
    from sglite.runtime.speculative.decoder import _rows_before_forced
    from sglite.runtime.step_plan import StepEntry

    # one chain: rows 0 (root), 1 text, 2 close, 3 and 4 forced; rows 2 and 3 only precede forced text
    assert _rows_before_forced([[5, 6, 7, 8]], [["text", CLOSE, FORCED, FORCED]]) == {2, 3}
    # a tree: chain 0 = rows 1, 2; chain 1 = rows 3, 4, 5 (in layout order)
    assert _rows_before_forced([[5, 6], [7, 8, 9]], [["text", FORCED], ["text", "text", FORCED]]) == {1, 4}
    assert _rows_before_forced([[5, 6]], [["text", "text"]]) == frozenset()
    e = StepEntry(req=None, n=5, start=0, draft=(5, 6, 7, 8), skip_rows=frozenset({2, 3}))
    e.sample_row = 1
    logits = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # row 0 belongs to another entry
    rows = e.verify_rows(logits)
    assert rows.shape == (5, 3) and torch.equal(rows[[0, 1, 4]], logits[1:4]) and not rows[[2, 3]].any()


# ---------------------------------------------------------------------- forbidden draft tokens (unit)
class _Matcher:
    """A grammar allowing only tokens in ``allowed`` (rollback counted)."""

    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def fill_next_token_bitmask(self, bitmask, row=0):
        bitmask[row].zero_()
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, t):
        if t not in self.allowed:
            return False
        self.accepted.append(t)
        return True

    def is_terminated(self):
        return False

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]


def test_grammar_forbidden_draft_token_ends_the_draft():
    from sglite.runtime.sampler import Sampler
    from sglite.runtime.speculative.decoder import SpecDecoder
    from sglite.runtime.speculative.state import SpecState

    class Cfg:
        speculative_algorithm, speculative_num_draft_tokens, speculative_disable_by_batch_size = "NGRAM", 4, 8
        page_size = 1

    class Req:
        grammar, spec = _Matcher({1, 2, 3}), SpecState()

    dec = SpecDecoder(Cfg, None, Sampler(40, frozenset()), None)
    r = Req()
    chains, masks = dec.grammar_walk.walk(r, [[2, 3, 7, 1], [1, 1], [9]])
    assert chains == [[2, 3], [1, 1], []]  # 7 and 9 are forbidden: each chain ends before them
    assert r.grammar.accepted == []  # rolled back
    assert [m.shape[0] for m in masks] == [1, 2, 2, 0] and int(masks[0][0, 0]) == 0b1110


# ---------------------------------------------------------------------- lazy greedy grammar walk (unit)
class _Grammar:
    """Allows the tokens of ``allowed`` (a function of the accepted tokens so far)."""

    def __init__(self, allowed):
        self.allowed, self.acc, self.fills = allowed, [], 0

    def fill_next_token_bitmask(self, m, row=0):
        self.fills += 1
        m[row].zero_()
        for t in self.allowed(self.acc):
            m[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, t):
        if t not in self.allowed(self.acc):
            return False
        self.acc.append(t)
        return True

    def is_terminated(self):
        return False

    def rollback(self, n):
        if n:
            del self.acc[-n:]


def test_greedy_walk_equals_prefix_matching_on_masked_rows():
    from sglite.kernels.reference import bitmask_to_additive
    from sglite.runtime.speculative.verify import verify_chain
    from sglite.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    V, W = 40, 2
    for trial in range(200):
        allowed_sets = [set(torch.randperm(V, generator=gen)[:12].tolist()) for _ in range(6)]
        allowed = lambda acc: allowed_sets[len(acc)]  # noqa: E731
        x = torch.randn(6, V, generator=gen)
        draft = []
        for i in range(5):  # draft: often the masked argmax, sometimes another allowed token
            masked = x[i].clone()
            masked[[t for t in range(V) if t not in allowed_sets[i]]] = float("-inf")
            pick = int(masked.argmax()) if trial % 3 else sorted(allowed_sets[i])[0]
            draft.append(pick)
        g = _Grammar(allowed)
        child = lambda row, t: row + 1 if row < len(draft) and draft[row] == t else None  # noqa: E731
        toks, rows = greedy_walk(x, child, g, W)
        assert g.acc == []  # rolled back
        # the oracle: every row masked by the grammar state after the draft tokens above it
        bm = torch.zeros(6, W, dtype=torch.int32)
        for i in range(6):
            for t in allowed_sets[i]:
                bm[i, t // 32] |= 1 << (t % 32)
        want, a = verify_chain(x + bitmask_to_additive(bm, V), draft, SamplingParams(max_new_tokens=8, temperature=0))
        assert toks == want and rows == list(range(a + 1))


def test_greedy_walk_rolls_back_when_the_grammar_raises():
    class Boom(_Grammar):
        def accept_token(self, t):
            if len(self.acc) == 2:
                raise RuntimeError("grammar failure")
            return super().accept_token(t)

    g = Boom(lambda acc: set(range(10)))
    x = torch.zeros(5, 10)
    x[:, 3] = 1.0
    with pytest.raises(RuntimeError):
        greedy_walk(x, lambda row, t: row + 1 if row < 4 else None, g, 1)
    assert g.acc == []


# ---------------------------------------------------------------------- grammar walk
@pytest.fixture
def walker(ngram_pair):
    _, spec = ngram_pair
    dec = spec.scheduler.spec
    tok = dec.out.tokenizer
    grammar = spec.requests.grammar_backend.compile("json_schema", json.dumps(SCHEMA))

    class R:
        pass

    def at(text: str):
        r = R()
        r.grammar = grammar.matcher()
        for t in tok.encode(text):
            assert r.grammar.accept_token(t)
        return r

    return dec, tok, at


def test_walk_closes_a_copied_value_and_appends_the_forced_text(walker):
    dec, tok, at = walker
    r = at('{"name":"Tom')
    before = r.grammar.num_accepted
    chain = tok.encode(" Becker lives in Hamburg")
    sources = [["text"] * len(chain)]
    got, masks = dec.grammar_walk.walk(r, [chain], need_masks=False, sources=sources, limit=64)
    out = got[0]
    assert masks is None and r.grammar.num_accepted == before  # rolled back
    text = tok.decode(out)
    # the value stops at the word boundary, the string closes, the next key is forced text
    assert text.startswith(' Becker"') and '"city":' in text and 'lives' not in text
    assert sources[0][0] == "text" and sources[0][1] == CLOSE and set(sources[0][2:]) == {FORCED}
    assert len(sources[0]) == len(out)
    # the forced tail is exactly what jump-forward appends after the closing token
    g = at('{"name":"Tom')
    for t in out[:2]:
        assert g.grammar.accept_token(t)
    assert out[2:] == dec.out.jump_tokens(g.grammar)
    # sampled requests get a mask row per node, the forced ones included
    _, masks = dec.grammar_walk.walk(at('{"name":"Tom'), [chain], need_masks=True, sources=[["text"] * len(chain)], limit=64)
    assert masks[1].shape[0] == len(out)


def test_walk_without_room_ends_before_the_closing_token(walker):
    dec, tok, at = walker
    chain = tok.encode(" Becker lives in Hamburg")
    sources = [["text"] * len(chain)]
    got, _ = dec.grammar_walk.walk(at('{"name":"Tom'), [chain], need_masks=False, sources=sources, limit=2)
    assert got == [chain[:1]] and sources == [["text"] * len(chain)]
    # without sources (no labels) nothing is closed or appended: the old walk
    got, _ = dec.grammar_walk.walk(at('{"name":"Tom'), [chain], need_masks=False)
    assert got == [chain]


def test_walk_without_closes_goes_on_and_marks_the_boundaries(walker):
    """``close=False`` (a request whose values go on past word boundaries, as copied sentences):
    the copy is walked whole, no closing token is put in, the grammar is left where it was, and
    the positions where a close would have gone are reported for verification to learn from."""
    dec, tok, at = walker
    gw = dec.grammar_walk
    chain = tok.encode(" Becker lives in Hamburg")
    r = at('{"name":"Tom')
    before = r.grammar.num_accepted
    sources, points = [["text"] * len(chain)], []
    got, masks = gw.walk(r, [chain], need_masks=True, sources=sources, limit=64, close=False, close_points=points)
    assert got == [chain] and sources == [["text"] * len(chain)] and r.grammar.num_accepted == before
    want_points = [i for i in range(1, len(chain)) if gw.value_ends_before(chain, i)]
    assert points == [want_points] and len(want_points) == 3  # before " lives", " in", " Hamburg"
    # the mask rows are the grammar's own after each token (the matcher really walked the chain)
    g = at('{"name":"Tom').grammar
    for i, t in enumerate(chain):
        assert g.accept_token(t)
        row = torch.full((1, masks[1].shape[1]), -1, dtype=torch.int32)
        g.fill_next_token_bitmask(row, 0)
        assert torch.equal(masks[1][i:i + 1], row)
    # with closes on, the same chain still closes at the first boundary (the default)
    got, _ = gw.walk(at('{"name":"Tom'), [chain], need_masks=False, sources=[["text"] * len(chain)], limit=64)
    assert 'lives' not in tok.decode(got[0])


def test_the_mask_row_after_the_grammar_ends_allows_everything(walker):
    """A chain whose last token ends the grammar: the request ends at that token, so the bonus
    row after it is drawn and dropped; its mask must leave some token (a terminated matcher
    allows only EOS, which min_new_tokens blocks: a row with no mass failed the sampled step)."""
    dec, tok, at = walker
    r = at('{"name":"Tom","city":"Ham')
    chain = tok.encode('burg"}')
    got, masks = dec.grammar_walk.walk(r, [chain], need_masks=True, sources=[["text"] * len(chain)], limit=64,
                                       close=False, close_points=[])
    assert got == [chain] and masks[1].shape[0] == len(chain)
    assert bool((masks[1][-1] == -1).all())  # after the closing brace: no constraint
    assert not bool((masks[1][0] == -1).all())  # inside the string: the grammar's own row


def test_close_outcomes_count_the_boundaries_the_model_passed_or_closed_at(walker):
    dec, tok, _ = walker
    gw = dec.grammar_walk
    chain = tok.encode(" Becker lives in Hamburg")
    points = [i for i in range(1, len(chain)) if gw.value_ends_before(chain, i)]  # " lives", " in", " Hamburg"
    quote, word = tok.encode('"')[0], tok.encode(" and")[0]
    # the model went on through two boundaries, then closed at the third: 1 kept of 3 tried
    assert gw.close_outcomes(points, points[2], chain[:points[2]] + [quote]) == (1, 3)
    # ... or wrote another word there: 0 of 3
    assert gw.close_outcomes(points, points[2], chain[:points[2]] + [word]) == (0, 3)
    # kept the whole chain, the bonus after it: the boundaries passed count, the bonus is no boundary
    assert gw.close_outcomes(points, len(chain), chain + [quote]) == (0, 3)
    # refused the first token: nothing learned
    assert gw.close_outcomes(points, 0, [word]) == (0, 0)


# ---------------------------------------------------------------------- engine
def test_copies_without_closing_drafts_stay_greedy_identical_and_teach_the_gate(ngram_pair, monkeypatch):
    """With the close gate shut (``CLOSE_MIN_RATE`` above 1: never a closing draft) oracle drafts
    run through string values past word boundaries: same tokens as without speculation, and the
    boundaries the model passed or closed at are counted for the ``close`` source."""
    from sglite.runtime.speculative import decoder as decoder_mod

    base, spec = ngram_pair
    dec = spec.scheduler.spec
    monkeypatch.setattr(decoder_mod, "CLOSE_MIN_RATE", 1.01)
    prompts = ["Tom Becker lives in Hamburg. " * 3 + "JSON:", "Maria Gonzalez lives in Seville and works. JSON:"]
    sps = [{"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)}] * 2
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    tried = dec.accept.counts.get(CLOSE, [0.0, 0.0])[1]
    with oracle_drafts(spec, {tuple(spec.tokenizer.encode(p)): w for p, w in zip(prompts, want)}, 6):
        assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want
        assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
    assert dec.accept.counts[CLOSE][1] > tried  # learned without drafting a single close
    spec.check_invariants()


def test_oracle_drafts_verify_forced_text_greedy_identical(ngram_pair):
    """Drafts taken from the plain run's own output (so every closing token and the key text
    after it are in the chains): same tokens as without speculation, alone and batched, greedy
    and with a penalty; forced text was verified inside chains (not left pending)."""
    base, spec = ngram_pair
    dec = spec.scheduler.spec
    prompts = ["Tom Becker lives in Hamburg. " * 3 + "JSON:", "Maria Gonzalez lives in Seville. JSON:"]
    sps = [{"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
           {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA), "frequency_penalty": 0.3}]
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    with oracle_drafts(spec, {tuple(spec.tokenizer.encode(p)): w for p, w in zip(prompts, want)}, 6):
        before, skipped = dec.stats["spec_forced_tokens"], dec.stats["spec_head_rows_skipped"]
        assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want
        assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
        assert dec.stats["spec_forced_tokens"] > before
        assert dec.stats["spec_head_rows_skipped"] > skipped  # rows before forced text left out of the LM head
    spec.check_invariants()


@pytest.mark.slow
def test_sampled_requests_with_forced_drafts_keep_the_model_distribution(tiny_model_dir):
    """Sampling (temperature 1, top-k 20) under a regex whose middle is forced text, drafts from a
    prompt that spells the sentences: a draft runs through the first choice and the forced
    ``" fox jumps "`` (verified as forced tokens), and both choices are distributed as the model
    says given the tokens before them (:func:`sglite.testing.decision_z`, |z| < 4.5)."""
    from sglite import Engine
    from sglite.testing import decision_z

    regex = r"(red|blue) fox jumps (high|low)\."
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64,
                  dtype="float32", device="cpu", max_total_tokens=8192)
    try:
        prompt = "red fox jumps high. blue fox jumps low. red fox jumps low. blue fox jumps high. "
        n = 600
        sps = [{"max_new_tokens": 12, "temperature": 1.0, "top_k": 20, "sampling_seed": 31_337 + i, "regex": regex}
               for i in range(n)]
        outs = spec.generate([prompt] * n, sps)
        assert spec.scheduler.spec.stats["spec_forced_tokens"] > 0
        grammar = spec.requests.grammar_backend.compile("regex", regex)
        z = decision_z(tiny_model_dir, spec.tokenizer, spec.tokenizer.encode(prompt), outs,
                       [("", "r"), ("jumps", " h")], grammar, top_k=20)
        assert all(abs(v) < 4.5 for v in z.values()), z
        assert len({o["text"] for o in outs}) == 4
    finally:
        spec.shutdown()
