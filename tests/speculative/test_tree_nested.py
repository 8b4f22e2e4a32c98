"""Token trees that branch below the root (EAGLE-2's kept nodes, issue 29): the walk accepts the
longest path whose every token is the target's, even when it leaves chain 0 (the root's most
confident chain); sampled walks keep every token distributed as the target's ``p``; engines with
such trees (greedy and seeded sampling, stop strings, a regex grammar) give the plain engine's
output token for token; EAGLE's drafter emits them from random heads.

Oracles: hand-built logits with a known argmax path; chi-square against ``target_probs``; the
plain engine's output; the KV manager's invariants after every step (``check_invariants``)."""
import random

import pytest
import torch

from sglite import Engine
from sglite.runtime.speculative import target_probs
from sglite.runtime.speculative.head_proposer import _chains
from sglite.runtime.speculative.proposer import EntryProposer
from sglite.runtime.speculative.tree import ROOT, TreeDraft, prune, verify_tree
from sglite.runtime.speculative.verify import Draws
from sglite.sampling_params import SamplingParams
from tests.speculative.prompts import COPY_PROMPTS
from tests.speculative.test_exact_sampling import chi_square_p

pytestmark = pytest.mark.usefixtures("one_thread")

# chain 0: 1 2 3 off the root; chain 1: 4 5 under chain 0's first node; chain 2: 6 under chain 1's
# first node; chain 3: 7 off the root.     root -+- 1 -+- 2 - 3
#                                                |     +- 4 -+- 5
#                                                |           +- 6
#                                                +- 7
TREE = dict(chains=[[1, 2, 3], [4, 5], [6], [7]], parents=[ROOT, (0, 1), (1, 1), ROOT])


def _greedy_rows(targets):
    x = torch.full((len(targets), 10), -5.0)
    for row, tok in enumerate(targets):
        x[row, tok] = 5.0
    return x


def test_nested_tree_geometry():
    t = TreeDraft(**TREE)
    assert t.nested and t.depths() == [1, 2, 3, 2, 3, 3, 1]
    assert t.paths() == [[1], [1, 2], [1, 2, 3], [1, 4], [1, 4, 5], [1, 4, 6], [7]]
    t.rows = [10, 11, 12, 13]
    assert t.scratch_paths() == [(11, [0, 3, 4]), (12, [0, 3, 5]), (13, [6])]
    pos, rows, lens = t.layout(10, 20, 8)  # one pending token (the root at 20), then 7 nodes
    assert pos == [20, 21, 22, 23, 22, 23, 23, 21] and rows == [10, 10, 10, 10, 11, 11, 12, 13]
    assert lens == [p + 1 for p in pos]
    assert t.accepted(2, 3) == [0, 3, 5] and t.kept_per_chain(2, 3) == [1, 1, 1, 0]
    assert t.accepted_order(2, 3) == [0, 3, 5, 1, 2, 4, 6]
    with pytest.raises(ValueError, match="parents"):
        TreeDraft([[1], [2]], parents=[ROOT, (0, 2)])
    with pytest.raises(ValueError, match="same token"):
        TreeDraft([[1, 2], [2]], parents=[ROOT, (0, 1)])


def test_greedy_walk_leaves_chain_zero():
    """The argmax path root -> 1 -> 4 -> 6 crosses three chains; its bonus token follows."""
    # rows: root, then the nodes in layout order (1, 2, 3, 4, 5, 6, 7)
    x = _greedy_rows([1, 4, 0, 0, 6, 0, 9, 0])
    assert verify_tree(x, TreeDraft(**TREE), SamplingParams(max_new_tokens=8, temperature=0)) == ([1, 4, 6, 9], 3, 2)
    x = _greedy_rows([1, 4, 0, 0, 8, 0, 9, 0])  # a miss under 4: the path stops in chain 1
    assert verify_tree(x, TreeDraft(**TREE), SamplingParams(max_new_tokens=8, temperature=0)) == ([1, 4, 8], 2, 1)
    x = _greedy_rows([7, 0, 0, 0, 0, 0, 0, 3])
    assert verify_tree(x, TreeDraft(**TREE), SamplingParams(max_new_tokens=8, temperature=0)) == ([7, 3], 1, 3)


def test_sampled_nested_walk_matches_the_target_distribution():
    """At the node under two children (1 -> {2, 4}) and one level below (4 -> {5, 6}), every
    output token is distributed as ``p`` of the row that predicts it."""
    torch.manual_seed(3)
    x = torch.randn(8, 10) * 1.5
    x[0, 1] += 3.0  # the root's child 1 is often drawn
    x[1, 4] += 1.0
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=6)
    p = target_probs(x, params)
    tree = TreeDraft(**TREE)
    n, V = 2500, 10
    first, after1, after14 = [0] * V, [0] * V, [0] * V
    for i in range(n):
        toks, a, chain = verify_tree(x, tree, params, Draws(5_000 + i, 0))
        assert len(toks) == a + 1 and [tree.tokens[j] for j in tree.accepted(chain, a)] == toks[:a]
        first[toks[0]] += 1
        if toks[0] == 1:
            after1[toks[1]] += 1
            if toks[1] == 4:
                after14[toks[2]] += 1
    assert sum(after14) > 60
    assert chi_square_p(first, p[0].tolist(), n) > 1e-3
    assert chi_square_p(after1, p[1].tolist(), sum(after1)) > 1e-3
    assert chi_square_p(after14, p[4].tolist(), sum(after14)) > 1e-3  # row 4: node 4's prediction


def test_eagle_rerank_keeps_a_tree_branching_below_the_root():
    # (token, parent, cumulative log-prob, depth): the best depth-2 node sits under the second child
    nodes = [(10, -1, -0.1, 1), (11, -1, -0.5, 1), (12, 0, -2.0, 2), (13, 0, -0.3, 2), (14, 1, -0.6, 2),
             (15, 3, -0.4, 3), (16, 3, -0.9, 3), (17, 2, -2.5, 3)]
    chains = _chains(nodes, 6, 4, "eagle")
    assert chains == [([10, 13, 15], ["eagle"] * 3, ROOT), ([11, 14], ["eagle"] * 2, ROOT),
                      ([16], ["eagle"], (0, 2))]
    TreeDraft([c for c, _, _ in chains], parents=[p for _, _, p in chains])  # a valid tree
    assert prune([[10], [11, 14], [16]], [ROOT, ROOT, (1, 2)], [1, 2]) == ([1, 2], [ROOT, (0, 2)])  # renumbered
    assert prune([[10], [11], [16]], [ROOT, ROOT, (0, 2)], [0, 1, 2]) == ([0, 1], [ROOT, ROOT])  # parent cut


def _nested_proposer(rng: random.Random, vocab: int, continuation: dict):
    """Trees around the plain continuation ``w``: chain 0 = [w0, wrong], chain 1 under w0 = the
    rest of ``w`` (random mistakes now and then), a stray chain off the root."""
    def fn(e):
        r = e.req
        want = next((v for ids, v in continuation.items() if tuple(r.input_ids[-len(ids):]) == ids), [])
        w = list(want[len(r.output_ids):len(r.output_ids) + 5])
        if len(w) < 2:
            return []
        w = [t if rng.random() < 0.85 else rng.randrange(vocab) for t in w]
        wrong = (w[1] + 1) % vocab
        chains = [([w[0], wrong], ["text"] * 2, ROOT), (w[1:], ["text"] * (len(w) - 1), (0, 1))]
        stray = rng.randrange(vocab)
        if stray != w[0]:
            chains.append(([stray], ["text"], ROOT))
        return chains
    return fn


KW = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True)


@pytest.mark.parametrize("sampled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_with_nested_trees_gives_the_plain_output(tiny_model_dir, sampled):
    """Greedy (with a stop string and a regex grammar) or seeded sampling: one output, the plain
    engine's; steps accept more than one node though chain 0 holds one right token only."""
    prompts = COPY_PROMPTS[:2] + ["abab abab abab ab"]
    if sampled:
        sps = [{"max_new_tokens": 20, "temperature": 0.8, "sampling_seed": 11 + i, "top_k": 8} for i in range(3)]
    else:
        sps = [{"max_new_tokens": 24, "temperature": 0}, {"max_new_tokens": 20, "temperature": 0, "stop": [" lazy"]},
               {"max_new_tokens": 20, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"}]
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = base.generate(prompts, sps)
        ids = [tuple(base.tokenizer.encode(p)) for p in prompts]
    finally:
        base.shutdown()
    cont = {i: w["output_ids"] for i, w in zip(ids, want)}
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64, **KW)
    try:
        spec.scheduler.spec.proposer = EntryProposer(_nested_proposer(random.Random(1), 256, cont))
        got = spec.generate(prompts, sps)
        st = spec.get_server_info()
    finally:
        spec.shutdown()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    # chain 0 accepts at most one node: more accepted than verify steps needs paths below chain 1
    assert st["spec_tree_steps"] > 0 and st["spec_accepted_tokens"] > st["spec_verify_steps"], st
    assert st["available_tokens"] == st["max_total_tokens"]


def test_eagle_with_random_heads_drafts_nested_trees_and_keeps_greedy(tiny_model_dir, tmp_path):
    """Random (untrained) EAGLE heads: the drafter's trees branch below the root, and greedy
    output (a stop string and a regex grammar among the requests) is the plain engine's."""
    import json

    from sglite.runtime.speculative.heads import EagleHead, save_heads

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    torch.manual_seed(0)
    save_heads(EagleHead(dict(hidden_size=cfg["hidden_size"], intermediate_size=96, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=cfg["vocab_size"], rms_norm_eps=1e-6,
                              rope_theta=10000.0)), tmp_path / "eagle")
    prompts = COPY_PROMPTS[:2] + ["abab abab abab ab"]
    sps = [{"max_new_tokens": 24, "temperature": 0}, {"max_new_tokens": 20, "temperature": 0, "stop": [" lazy"]},
           {"max_new_tokens": 20, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"}]
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want = base.generate(prompts, sps)
    finally:
        base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "eagle"),
                  **KW)
    nested = []
    try:
        inner = spec.scheduler.spec.proposer
        real = inner.propose

        def spy(entries, rooms, budget):
            out = real(entries, rooms, budget)
            nested.extend(any(len(c) > 2 and c[2] != ROOT for c in chains) for chains in out)
            return out
        inner.propose = spy
        got = spec.generate(prompts, sps)
    finally:
        spec.shutdown()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert any(nested), "no tree branched below the root"
