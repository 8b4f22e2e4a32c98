"""Cascade (shared-prefix) decode attention on the AMX tiles (csrc/cpu_attention.cpp +
csrc/amx_attention.h) and on the bf16 dot-product tiles off them (csrc/decode_dot_cascade.h):
batches whose rows share radix-cache prefixes, against the float64 oracle and the per-row path
(cascade_min=0); the groups found; the dispatcher keeps deterministic mode off the cascade."""

import pytest
import torch

from tests.kernels.builds import built
from sglite.kernels import cpu_attention, dispatch


@pytest.fixture(scope="module")
def ops():
    mod = built(cpu_attention.load)
    if not cpu_attention.amx_ready() and not cpu_attention.dot_cascade_built():
        pytest.skip("neither AMX tiles nor AVX512-BF16 on this CPU (the cascade runs only there)")
    return mod


@pytest.fixture(params=["amx", "dot"])
def cmin(request, ops):
    """The cascade_min that takes each set of tiles: 64 (AMX where granted), -64 (the dot tiles)."""
    if request.param == "amx" and not cpu_attention.amx_ready():
        pytest.skip("no AMX tiles on this CPU")
    if request.param == "dot" and not cpu_attention.dot_cascade_built():
        pytest.skip("this build has no AVX512-BF16 dot-product tiles")
    return 64 if request.param == "amx" else -64


def make_batch(groups, singles, Hq, Hkv, D, seed=0, head_major=True):
    """A bf16 pool and a batch: ``groups`` = [(prefix_len, [own lens])]: the rows of a group share
    the prefix's slots, then each has ``own`` slots of its own; ``singles``: rows with nothing
    shared. Rows are shuffled in the batch and sit at shuffled rows of the slot table."""
    g = torch.Generator().manual_seed(seed)
    specs = [(pi, own) for pi, (P, owns) in enumerate(groups) for own in owns] + [(None, L) for L in singles]
    total = sum(P for P, _ in groups) + sum(own for _, own in specs)
    S = total + 17
    perm = (torch.randperm(S - 1, generator=g) + 1).to(torch.int32)
    nxt = 0

    def take(n):
        nonlocal nxt
        out = perm[nxt:nxt + n]
        nxt += n
        return out

    prefix = [take(P) for P, _ in groups]
    B = len(specs)
    Lmax = max((groups[pi][0] if pi is not None else 0) + own for pi, own in specs) + 3
    rt = torch.randint(0, S, (B + 2, Lmax), generator=g, dtype=torch.int32)
    order = torch.randperm(B, generator=g).tolist()
    rows = torch.randperm(B + 2, generator=g)[:B]
    lens = torch.empty(B, dtype=torch.int64)
    for b, k in enumerate(order):
        pi, own = specs[k]
        slots = take(own) if pi is None else torch.cat([prefix[pi], take(own)])
        rt[rows[b], :len(slots)] = slots
        lens[b] = len(slots)
    if head_major:
        k = torch.randn(Hkv, S, D, generator=g).bfloat16().transpose(0, 1)
        v = torch.randn(Hkv, S, D, generator=g).bfloat16().transpose(0, 1)
    else:
        k = torch.randn(S, Hkv, D, generator=g).bfloat16()
        v = torch.randn(S, Hkv, D, generator=g).bfloat16()
    q = torch.randn(B, Hq, D, generator=g).bfloat16()
    return q, k, v, rt, rows, lens, D ** -0.5


def oracle(q, k, v, rt, rows, lens, scale):
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        slots = rt[rows[b], :int(lens[b])].long()
        for h in range(Hq):
            kk, vv = k[slots, h // G].double(), v[slots, h // G].double()
            out[b, h] = torch.softmax(q[b, h].double() @ kk.T * scale, -1) @ vv
    return out


CASES = [  # (groups, singles, Hq, Hkv, D)
    ([(600, [5, 9, 1, 30, 2, 7, 3, 12, 4, 6, 8, 10, 11, 13, 14, 15]), (300, [3, 40])], [20, 700], 9, 3, 64),
    ([(64, [1, 2]), (200, [1] * 30)], [1], 9, 3, 64),  # 30 rows x 3 heads: two 64-row chunks
    ([(130, [4, 5, 6])], [], 8, 2, 128),
    ([(257, [1, 64, 3]), (90, [2, 2])], [5, 300], 4, 1, 256),  # Gemma 3's head dim
    ([(100, [3, 4])], [7], 6, 2, 40),  # D padded to 64 (tiles: 64)
]


@pytest.mark.parametrize("groups,singles,Hq,Hkv,D", CASES)
def test_cascade_matches_oracle_and_per_row_path(ops, cmin, groups, singles, Hq, Hkv, D):
    case = make_batch(groups, singles, Hq, Hkv, D, seed=len(singles) + D)
    found = cpu_attention.shared_prefix_groups(*case[3:6], min_shared=64)
    assert sorted(P for P, _ in found) == sorted(P for P, _ in groups)  # each group found, its whole prefix
    casc = cpu_attention.decode_attention(*case, cascade_min=cmin).double()
    rowwise = cpu_attention.decode_attention(*case, cascade_min=0).double()
    want = oracle(*case)
    torch.testing.assert_close(casc, want, atol=1.5e-2, rtol=1.5e-2)
    err, row_err = (casc - want).abs().mean(), (rowwise - want).abs().mean()
    assert err <= 2 * row_err + 1e-4, (err, row_err)  # bf16 queries / weights on the tiles: same order of error


def test_groups_pick_the_longest_shared_run(ops):
    """Rows of one bucket (same first slot) sharing 600, 600, 600 and 10 keys: the three form the
    group (P = 600 x 2 saved beats 10 x 3); min_shared filters; singles never group."""
    q, k, v, rt, rows, lens, _ = make_batch([(600, [3, 4, 5])], [50, 60], 9, 3, 64, seed=3)
    b_short = int(torch.nonzero(lens == 603)[0])  # one of the group's rows; clone it diverging at 10
    rt2 = torch.cat([rt, rt[rows[b_short]:rows[b_short] + 1].clone()])
    rt2[-1, 10:] = torch.arange(rt2.shape[1] - 10, dtype=torch.int32) + 5000
    rows2 = torch.cat([rows, torch.tensor([rt2.shape[0] - 1])])
    lens2 = torch.cat([lens, torch.tensor([40])])
    found = cpu_attention.shared_prefix_groups(rt2, rows2, lens2, min_shared=64)
    assert len(found) == 1 and found[0][0] == 600 and len(found[0][1]) == 3 and len(rows2) - 1 not in found[0][1]
    assert cpu_attention.shared_prefix_groups(rt2, rows2, lens2, min_shared=601) == []
    assert cpu_attention.shared_prefix_groups(rt, rows[:1], lens[:1]) == []


def test_cascade_rows_keep_their_own_keys_and_bad_slots_raise(ops, cmin):
    q, k, v, rt, rows, lens, scale = make_batch([(200, [1, 1, 1])], [], 9, 3, 64, seed=5)
    out = cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=cmin)
    torch.testing.assert_close(out.double(), oracle(q, k, v, rt, rows, lens, scale), atol=1.5e-2, rtol=1.5e-2)
    bad = rt.clone()
    bad[rows, 5] = k.shape[0] + 3  # in every row: the shared prefix holds a slot outside the pool
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_attention.decode_attention(q, k, v, bad, rows, lens, scale, cascade_min=cmin)
    bad = rt.clone()
    bad[rows[1], int(lens[1]) - 1] = -2  # one grouped row's own (last) key: own_keys' / attend's check
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_attention.decode_attention(q, k, v, bad, rows, lens, scale, cascade_min=cmin)


def test_deterministic_dispatch_never_cascades(ops, monkeypatch):
    """batch_invariant=True gives each row the per-row path's bits whatever its batch."""
    q, k, v, rt, rows, lens, scale = make_batch([(300, [2, 3, 4, 5])], [9], 9, 3, 64, seed=7)
    alone = [cpu_attention.decode_attention(q[b:b + 1], k, v, rt, rows[b:b + 1], lens[b:b + 1], scale) for b in range(len(rows))]
    inv = dispatch.decode_attention(q, k, v, rt, rows, lens, scale, impl="cpp", batch_invariant=True)
    assert all(torch.equal(inv[b:b + 1], alone[b]) for b in range(len(rows)))
    monkeypatch.setenv("SGLITE_ATTN_AMX", "0")
    assert cpu_attention.default_cascade_min() == 0
    assert torch.equal(cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale),
                       cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=0))


def test_groups_under_a_short_common_head(ops, cmin):
    """Every row starting with the same few slots (a chat template's first tokens) still splits into
    one group per long prefix, each with its whole prefix, and the results stay right."""
    q, k, v, rt, rows, lens, scale = make_batch([(500, [1, 2, 3, 4]), (400, [5, 6, 7]), (300, [2, 2])], [80], 9, 3, 64, seed=11)
    rt[rows, :5] = rt[rows[0], :5].clone()
    found = cpu_attention.shared_prefix_groups(rt, rows, lens, min_shared=64)
    assert sorted((P, len(r)) for P, r in found) == [(300, 2), (400, 3), (500, 4)]
    out = cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=cmin)
    torch.testing.assert_close(out.double(), oracle(q, k, v, rt, rows, lens, scale), atol=1.5e-2, rtol=1.5e-2)


def test_cascade_with_softcap(ops, cmin):
    """Soft-capping (Gemma 2) applies to the shared keys' scores on the tiles and to each row's own."""
    q, k, v, rt, rows, lens, scale = make_batch([(150, [2, 5, 9])], [30], 8, 2, 64, seed=13)
    q = q * 4  # large scores, so the cap matters
    out = cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, 0, 5.0, cascade_min=cmin)
    want = torch.empty(out.shape, dtype=torch.float64)
    for b in range(len(rows)):
        slots = rt[rows[b], :int(lens[b])].long()
        for h in range(8):
            s = q[b, h].double() @ k[slots, h // 4].double().T * scale
            want[b, h] = torch.softmax(5.0 * torch.tanh(s / 5.0), -1) @ v[slots, h // 4].double()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_groups_found_once_give_the_same_result(ops, cmin):
    """A caller attending many layers passes shared_prefix_groups' tensor (found once per step):
    the same bits as the op finding them; a malformed or mismatched one is a ValueError."""
    q, k, v, rt, rows, lens, scale = make_batch([(300, [2, 3, 4]), (120, [5, 6])], [7], 9, 3, 64, seed=17)
    rows, lens = rows.contiguous(), lens.contiguous()
    flat = ops.shared_prefix_groups(rt, rows, lens, 64)
    assert int(flat[0]) == 2
    found = ops.decode_attention(q, k, v, rt, rows, lens, scale, 0, 0.0, cmin, None)
    assert torch.equal(ops.decode_attention(q, k, v, rt, rows, lens, scale, 0, 0.0, cmin, flat), found)
    for bad in (torch.tensor([1, 300, 1, 0]), torch.tensor([1, 300, 2, 0, 0]), torch.tensor([1, 300, 2, 0, 99]),
                torch.tensor([2, 300, 2, 0, 1])):
        with pytest.raises(ValueError, match="groups"):
            ops.decode_attention(q, k, v, rt, rows, lens, scale, 0, 0.0, cmin, bad)


def groups_by_sort(rt, rows, lens, min_shared):
    """The grouping's definition: rows (len > min_shared) in lexicographic order of their slot rows;
    maximal runs of neighbours whose common prefix (capped at the shorter length - 1) is >=
    min_shared; P the smallest of them; rows ascending."""
    cand = [b for b in range(len(rows)) if int(lens[b]) > min_shared]
    seq = {b: rt[rows[b], :int(lens[b])].tolist() for b in cand}

    def lcp(a, b):
        cap, n = min(len(seq[a]), len(seq[b])) - 1, 0
        while n < cap and seq[a][n] == seq[b][n]:
            n += 1
        return n
    cand.sort(key=lambda b: (seq[b][:-1], len(seq[b]), b))
    out, i = [], 0
    while i < len(cand):
        e, P = i + 1, None
        while e < len(cand) and lcp(cand[e - 1], cand[e]) >= min_shared:
            P = lcp(cand[e - 1], cand[e]) if P is None else min(P, lcp(cand[e - 1], cand[e]))
            e += 1
        if e - i >= 2:
            out.append((P, sorted(cand[i:e])))
        i = e
    return out


def test_groups_match_the_sorted_runs_definition(ops):
    """shared_prefix_groups finds the classes of equal first-min_shared slots without sorting
    whole prefixes: the same groups, P and order as the lexicographic-runs definition, on random
    tables with few distinct slots (many ties, prefixes diverging anywhere, short rows)."""
    g = torch.Generator().manual_seed(23)
    nonempty = 0
    for _ in range(150):
        B, L = int(torch.randint(1, 24, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))
        base = torch.randint(0, 4, (int(torch.randint(1, 5, (1,), generator=g)), L), generator=g, dtype=torch.int32)
        rt = base[torch.randint(0, base.shape[0], (B + 2,), generator=g)].clone()
        for r in range(B + 2):
            d = int(torch.randint(0, L + 1, (1,), generator=g))
            rt[r, d:] = torch.randint(0, 3, (L - d,), generator=g, dtype=torch.int32)
        rows = torch.randint(0, B + 2, (B,), generator=g)
        lens = torch.randint(1, L + 1, (B,), generator=g)
        m = int(torch.randint(1, 12, (1,), generator=g))
        want = groups_by_sort(rt, rows, lens, m)
        assert cpu_attention.shared_prefix_groups(rt, rows, lens, min_shared=m) == want
        nonempty += bool(want)
    assert nonempty > 50


@pytest.mark.parametrize("Hq,Hkv,D,sizes", [
    (9, 3, 64, [45, 3]),     # G = 3: a group of 45 rows in three chunks (21, 21, 3) on own_keys
    (16, 1, 64, [10, 2]),    # G = 16: 4 rows a chunk, three chunks; the own keys through attend
    (8, 2, 128, [17, 5]),    # G = 4, D 128: own_keys' 4-block form, 16 rows a chunk
    (4, 1, 64, [16]),        # one group, one KV head: one chunk at 1 thread, two of 8 rows at 2
])
def test_cascade_chunks_threads_and_dtypes(ops, cmin, Hq, Hkv, D, sizes):
    """Groups spanning several 64 / G-row chunks, rows with one own key, rows outside every group
    mixed in: the float64 oracle holds for bf16 and float32 queries; every row's bits are the same
    at 1 and 2 threads (tile rows never mix, a task runs on one thread, whichever thread claims it)
    and with its group alone in the batch."""
    owns = [[1 + (7 * i) % 23 for i in range(n)] for n in sizes]
    case = make_batch([(P, own) for P, own in zip((300, 150), owns)], [1, 40, 333], Hq, Hkv, D, seed=D + Hq)
    q, k, v, rt, rows, lens, scale = case
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the oracle's many tiny ops: no thread wake-ups on a busy machine
        want = oracle(*case)
        outs = {}
        for th in (1, 2):
            torch.set_num_threads(th)
            for qd in (torch.bfloat16, torch.float32):
                outs[th, qd] = cpu_attention.decode_attention(q.to(qd), k, v, rt, rows, lens, scale, cascade_min=cmin)
        for qd in (torch.bfloat16, torch.float32):
            assert torch.equal(outs[1, qd], outs[2, qd])
            assert outs[1, qd].dtype == qd
            torch.testing.assert_close(outs[1, qd].double(), want, atol=1.5e-2, rtol=1.5e-2)
        rowwise = cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=0).double()
        assert (outs[1, torch.bfloat16].double() - want).abs().mean() <= 2 * (rowwise - want).abs().mean() + 1e-4
        # one group alone (other chunking of the other group's absence): the same bits for its rows
        found = cpu_attention.shared_prefix_groups(rt, rows, lens, min_shared=64)
        big = max(found, key=lambda x: len(x[1]))[1]
        sel = torch.tensor(big)
        alone = cpu_attention.decode_attention(q[sel], k, v, rt, rows[sel], lens[sel], scale, cascade_min=cmin)
        assert torch.equal(alone, outs[2, torch.bfloat16][sel])
    finally:
        torch.set_num_threads(prev)
