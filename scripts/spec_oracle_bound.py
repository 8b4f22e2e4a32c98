"""Upper bound of any NGRAM-style drafter on a ``sglite bench spec`` workload: the speculative
engine is given *oracle* drafts, the plain engine's own next output tokens (so every draft token
is kept, and the policy's cuts and the closing guesses are switched off), and its decode speed is
compared with the plain engine's, side by side, against the same engine with the real drafter.

What is left between the real drafter and the oracle is what better drafting can still win; what
the oracle itself misses of a large speed-up is the price of the verify rows on this machine.

Both engines' prefix caches are flushed before every request, so each prompt's KV is computed the
same way in both (bf16 without deterministic inference is only batch-invariant per step shape:
a prompt prefilled in other chunks can round differently and greedy output then drifts, which
would leave the oracle's drafts behind). The decode ratio excludes that prefill.

On bf16 pools a verify step's rows attend their shared cached prefix once as a group (the decode
cascade, from ``cpu_attention.CASCADE_MIN`` keys) where the plain row reads it row by row, so the
speculative output drifts from plain after some tens of tokens and the oracle's drafts fall
behind (accept length well under the draft length + 1). ``SGLITE_ATTN_AMX=0`` turns the cascade
off in both engines: every oracle draft is then kept (docs/speculative.md, "What is guaranteed").

Usage: python scripts/spec_oracle_bound.py [--workload extract_json] [--draft-tokens 8] [--rounds 3]
    [--real NGRAM|EAGLE|MEDUSA] [--max-new-tokens 128]

``--real EAGLE`` compares the oracle with the EAGLE heads (the open-chat case: ``--workload
chat_heldout``); the oracle engine keeps NGRAM's step machinery with no draft cost at all, so its
speed-up is the bound of any drafter at that draft length on this machine.
"""
from __future__ import annotations

import argparse
import logging
import time

from sglite import Engine
from sglite.bench.spec import _decode_part, workloads
from sglite.runtime.speculative.proposer import EntryProposer
from sglite.testing import oracle_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="extract_json")
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--real", default="NGRAM", choices=("NGRAM", "EAGLE", "MEDUSA"), help="the real drafter")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    items, _ = workloads(4)[a.workload]
    kw = dict(max_total_tokens=16384, max_running_requests=16)
    base = Engine(**kw)
    spec_kw = dict(kw, speculative_algorithm="NGRAM", speculative_num_draft_tokens=a.draft_tokens)
    engines = {"base": base, "real": Engine(**dict(spec_kw, speculative_algorithm=a.real)), "oracle": Engine(**spec_kw)}
    logging.getLogger("sglite").setLevel(logging.WARNING)
    prompts = [base.apply_chat_template([{"role": "user", "content": m}]) for m, _ in items]
    sps = [{"max_new_tokens": a.max_new_tokens, "temperature": 0, **x} for _, x in items]
    want = []
    for p, s in zip(prompts, sps):
        base.flush_cache()
        want.append((tuple(base.tokenizer.encode(p)), base.generate(p, s)["output_ids"]))

    dec = engines["oracle"].scheduler.spec
    dec.proposer = EntryProposer(oracle_drafter(dict(want), a.draft_tokens))
    dec.grammar_walk.close_values = False  # no closing guesses: the oracle knows where values end
    dec.budget._lengths = lambda proposals, entries: [[len(c) for c in chains] for (_, chains, _, _) in proposals]
    tot = {n: [0, 0.0] for n in engines}
    e2e = {n: [0, 0.0] for n in engines}  # whole requests, prefill included (what `sglite bench spec` calls the ratio)
    same = {n: 0 for n in engines}
    for rnd in range(a.rounds):
        for j, (p, s) in enumerate(zip(prompts, sps)):
            names = list(engines)
            names = names[(rnd + j) % len(names):] + names[:(rnd + j) % len(names)]  # rotate the order
            for n in names:
                eng = engines[n]
                eng.flush_cache()
                t0 = time.perf_counter()
                o = eng.generate(p, s)
                dt = time.perf_counter() - t0
                d_n, d_t = _decode_part([o], dt)
                e2e[n][0] += len(o["output_ids"])
                e2e[n][1] += dt
                tot[n][0] += d_n
                tot[n][1] += d_t
                same[n] += o["output_ids"] == want[j][1]
    rate = {n: t[0] / t[1] for n, t in tot.items()}
    whole = {n: t[0] / t[1] for n, t in e2e.items()}
    for n in ("real", "oracle"):
        st = engines[n].scheduler.spec.stats
        print(f"{a.workload} {n:6s}: decode x{rate[n] / rate['base']:.2f}  end to end x{whole[n] / whole['base']:.2f}  accept length "
              f"{(st['spec_accepted_tokens'] + st['spec_verify_steps']) / max(1, st['spec_verify_steps']):.2f}  "
              f"forced tokens {st['spec_forced_tokens']}  identical {same[n]}/{a.rounds * len(prompts)}")
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
