"""Issue 17 third pass: base vs NGRAM with the measured-cost draft policy vs NGRAM with the
second-pass rule (``scheduler.spec.cost = None``: row block, cap, cool-down), three engines on the
default model in one process, engine order rotated per request; greedy, 128 new tokens.

Usage: ``python scripts/spec_policy_ab.py copy_edit,extract_json,chat 2`` (workloads of
``sglite bench spec``, rounds). Prints per workload the tok/s ratio and the decode ratio of each
NGRAM engine over the base, and how many outputs equal the base's."""
import sys, time
from sglite import Engine
from sglite.bench.spec import _decode_part, workloads
names = sys.argv[1].split(","); rounds = int(sys.argv[2])
if any(n.endswith("_heldout") for n in names):  # issue 29: the held-out set stays out of tuning
    sys.exit("spec_policy_ab.py tunes the draft policy: the *_heldout workloads are not for tuning "
             "(measure them with `sglite bench spec`)")
kw = dict(max_total_tokens=16384, max_running_requests=16)
engs = {"base": Engine(**kw), "cost": Engine(**kw, speculative_algorithm="NGRAM"), "rowblock": Engine(**kw, speculative_algorithm="NGRAM")}
engs["rowblock"].scheduler.spec.cost = None
order = list(engs)
for wl in names:
    items, batch = workloads(4)[wl]
    prompts = [engs["base"].apply_chat_template([{"role": "user", "content": m}]) for m, _ in items]
    sps = [{"max_new_tokens": 128, "temperature": 0, **x} for _, x in items]
    for e in engs.values(): e.generate(prompts[:1], sps[:1])
    tot = {k: [0, 0.0, 0, 0.0] for k in engs}; outs = {}
    j = 0
    for rnd in range(rounds):
        for i in range(len(prompts)):
            rot = order[j % 3:] + order[:j % 3]; j += 1
            if j % 2: rot = rot[::-1]
            for k in rot:
                t0 = time.perf_counter(); o = engs[k].generate([prompts[i]], [sps[i]])[0]; t = time.perf_counter() - t0
                n_d, t_d = _decode_part([o], t)  # the decode phase, as sglite bench spec counts it
                tot[k][0] += len(o["output_ids"]); tot[k][1] += t; tot[k][2] += n_d; tot[k][3] += t_d
                outs.setdefault((k, i), o["output_ids"])
    b = tot["base"]
    same = {k: sum(outs[(k, i)] == outs[("base", i)] for i in range(len(prompts))) for k in engs}
    print(wl, " ".join(f"{k}: x{(v[0]/v[1])/(b[0]/b[1]):.2f} decode x{(v[2]/v[3])/(b[2]/b[3]):.2f} same {same[k]}/{len(prompts)}" for k, v in tot.items() if k != "base"), f"(base {b[0]/b[1]:.1f} tok/s)", flush=True)
for e in engs.values(): e.shutdown()
