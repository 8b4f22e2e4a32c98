"""``sglite bench spec``: decode speed with and without speculative decoding, side by side.

Two engines on the same model in one process (one with ``speculative_algorithm``, one without);
every request runs on both, alternating, so machine drift hits both alike. Workloads:

* ``copy_edit`` — rewrite a given paragraph with one change (copy-heavy: long spans repeat the
  prompt), batch 1;
* ``extract_json`` — extract fields of a given text into JSON under a JSON Schema (copy-heavy and
  grammar-constrained), batch 1;
* ``extract_sentences`` — copy the first and last sentence of a given text, word for word, into
  JSON under a JSON Schema (copy-heavy, grammar-constrained, long values), batch 1;
* ``chat`` — open questions (little to copy), batch 1;
* ``chat_batch16`` — 16 open questions in one batch (``--batch-sizes`` adds ``chat_batch<B>``
  workloads: the batch sweep);
* ``chat_heldout``, ``copy_edit_heldout`` — the held-out set (``spec_heldout.json`` beside this
  module): open questions and copy edits written after the speculative policy's constants were
  set and never used to tune them. The sets above are the ones the constants were tuned on; a
  method that only wins on them is fitted to them, so both are reported.

Every batch runs on an empty radix cache (``Engine.flush_cache`` before it, on both engines):
rounds repeat the same prompts, and a cached prompt would skip its prefill (and, before this
default, made later rounds faster than a fresh request). ``--reuse-cache`` keeps the cache
between batches (the old behaviour). Requests inside one batch may still share a prefix.

Reports tokens/s of each engine, the ratio, the decode-only ratio (tokens after the first over
the time after the first token: the part speculation can change; the prompt's prefill is the
same work in both engines), the mean accept length (tokens per verify step, bonus included) and
how many outputs are token-identical (greedy; exact in fp32, bf16 rows may round differently
when computed in a verify step).

Noise (the machine is shared: other processes' load comes and goes within a run, and a stall of
seconds happens): the ratio is total tokens over total time, so one slow burst during one
engine's batch moves it (x0.2 or x7 have been seen). Each line therefore also reports
``median x<r>``: the median of the per-batch ratios (each batch runs on both engines back to
back, the order alternating, so half the pairs see drift one way and half the other), with their
range (``[min-max]``, ``n`` pairs). A burst hits one pair, so the median barely moves; the
``chat_batch16`` line (both engines run the same code there: drafting is off above
``speculative_disable_by_batch_size``) shows the method's noise. More ``--rounds``: more pairs.
These fields are appended after the original ones (``results[name]["speedup_median"]`` and
``"pair_ratios"`` in ``--output-json``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Optional, Sequence

PARAGRAPH = ("The city council met on Tuesday evening to discuss the new library budget. After two hours of "
             "debate, the members agreed to extend the opening hours on weekends, to hire three additional "
             "librarians, and to replace the heating system before the winter. The mayor thanked the residents "
             "who had written letters in support of the library and promised a public report in March.")
PEOPLE = [("Maria Gonzalez", "maria.gonzalez@example.com", "Seville", "veterinarian"),
          ("Tom Becker", "t.becker@example.org", "Hamburg", "bus driver"),
          ("Aiko Tanaka", "aiko.tanaka@example.net", "Osaka", "architect"),
          ("Samuel Okoro", "sam.okoro@example.com", "Lagos", "accountant")]
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "email", "city", "job"],
                 "properties": {k: {"type": "string", "maxLength": 60} for k in ("name", "email", "city", "job")}}
TEXTS = [PARAGRAPH,
         "The museum will reopen its east wing on the first of June after a year of repairs. Visitors will be able to "
         "see the restored ceiling paintings and a new gallery of local photographs. Tickets can be booked online from "
         "next Monday, and entry stays free for children under twelve.",
         "Our team released version two of the mobile app last night. The update adds an offline mode, fixes the crash "
         "on older phones, and makes the search bar faster. Please report any new problems through the feedback form "
         "in the settings menu.",
         "Heavy rain is expected across the northern valleys from Thursday afternoon. Rivers may rise quickly, so "
         "campers should move away from the banks. The weather service will publish an update every six hours until "
         "the storm has passed."]
SENTENCES_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["first_sentence", "last_sentence"],
                    "properties": {k: {"type": "string", "maxLength": 300} for k in ("first_sentence", "last_sentence")}}
CHAT = ["What are three good habits for staying healthy?", "Tell me a short story about a dragon.",
        "Why is the sky blue?", "Give me some tips for learning to cook.", "What is a black hole?",
        "How do plants make food?", "Suggest a name for a coffee shop and explain it.",
        "What should I pack for a beach holiday?"]


HELDOUT_FILE = pathlib.Path(__file__).with_name("spec_heldout.json")


def heldout() -> dict:
    """The held-out prompts: ``{"chat": [question], "copy_edit": [[instruction, paragraph]]}``
    from ``spec_heldout.json`` (no policy constant was tuned on them)."""
    return json.loads(HELDOUT_FILE.read_text())


def workloads(n: int, batches: Sequence[int] = ()) -> dict:
    """name -> (list of (chat messages, extra sampling params), batch size); ``batches`` adds a
    ``chat_batch<B>`` workload (B open questions in one batch) per size, for the batch sweep.
    The ``*_heldout`` workloads come from :func:`heldout`."""
    edits = [("Rewrite the following paragraph exactly as it is, but change 'Tuesday' to '%s'.\n\n%s"
              % (day, PARAGRAPH)) for day in ("Monday", "Friday", "Sunday", "Wednesday")]
    people = [f"{nm} lives in {city} and works as a {job}. You can reach {nm.split()[0]} at {mail}. "
              f"Extract the name, email, city and job of this person as JSON." for nm, mail, city, job in PEOPLE]
    schema = json.dumps(PERSON_SCHEMA)
    held = heldout()
    return {
        "copy_edit": ([(e, {}) for e in edits][:n], 1),
        "extract_json": ([(p, {"json_schema": schema}) for p in people][:n], 1),
        "extract_sentences": ([(f"{t}\n\nCopy the first sentence and the last sentence of this text, word for word, "
                                f"into JSON.", {"json_schema": json.dumps(SENTENCES_SCHEMA)}) for t in TEXTS][:n], 1),
        "chat": ([(c, {}) for c in CHAT][:n], 1),
        "chat_batch16": ([(CHAT[i % len(CHAT)], {}) for i in range(16)], 16),
        **{f"chat_batch{b}": ([(CHAT[i % len(CHAT)], {}) for i in range(max(b, 4))], b) for b in batches if b != 16},
        "chat_heldout": ([(c, {}) for c in held["chat"]][:n], 1),
        "copy_edit_heldout": ([(f"{ins}\n\n{par}", {}) for ins, par in held["copy_edit"]][:n], 1),
    }


def _run(engine, prompts, sps, batch, fresh: bool = False):
    """Generate ``prompts`` in batches of ``batch``; ``fresh``: empty the radix cache before each
    batch (not timed). Returns (outputs, seconds)."""
    if fresh:
        return _run_fresh(engine, prompts, sps, batch)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        o = engine.generate(prompts[i:i + batch], sps[i:i + batch])
        outs.extend(o)
    return outs, time.perf_counter() - t0


def _run_fresh(engine, prompts, sps, batch):
    outs, seconds = [], 0.0
    for i in range(0, len(prompts), batch):
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused: the engine still has requests")
        t0 = time.perf_counter()
        outs.extend(engine.generate(prompts[i:i + batch], sps[i:i + batch]))
        seconds += time.perf_counter() - t0
    return outs, seconds


def _decode_part(outs, seconds) -> tuple[int, float]:
    """(tokens after each request's first, seconds after the batch's last first token) of one
    batch: the decode phase, without the prompt's prefill."""
    ttft = max((o["meta_info"].get("ttft") or 0.0) for o in outs)
    return sum(max(0, len(o["output_ids"]) - 1) for o in outs), max(seconds - ttft, 1e-9)


def run(a: argparse.Namespace) -> dict:
    from sglite import Engine

    kw = {k: v for k, v in dict(model_path=a.model_path, dtype=a.dtype, max_total_tokens=a.max_total_tokens,
                                max_running_requests=16).items() if v is not None}
    base = Engine(**kw)
    if a.speculative_disable_by_batch_size:
        kw_spec = {"speculative_disable_by_batch_size": a.speculative_disable_by_batch_size}
    else:
        kw_spec = {}
    spec = Engine(**kw, **kw_spec, speculative_algorithm=a.speculative_algorithm,
                  speculative_verify=a.speculative_verify,
                  speculative_num_draft_tokens=a.speculative_num_draft_tokens,
                  **({"speculative_draft_model_path": a.speculative_draft_model_path}
                     if a.speculative_draft_model_path else {}))
    results = {}
    try:
        for name, (items, batch) in workloads(a.num_prompts, a.batch_sizes or ()).items():
            if a.workloads and name not in a.workloads:
                continue
            prompts = [base.apply_chat_template([{"role": "user", "content": m}]) for m, _ in items]
            sps = [{"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, **x,
                    **({"sampling_seed": a.sampling_seed + k} if a.sampling_seed is not None else {})}
                   for k, (_, x) in enumerate(items)]
            fresh = not a.reuse_cache
            _run(base, prompts[:1], sps[:1], 1)  # warm both (kernels, grammar caches)
            _run(spec, prompts[:1], sps[:1], 1)
            tb = ts = 0.0
            nb = ns = 0
            dec = {"base": [0, 0.0], "spec": [0, 0.0]}
            same, steps, verified = 0, 0, 0
            pairs: list = []  # per batch: spec tok/s over base tok/s
            for j, i in enumerate(list(range(0, len(prompts), batch)) * a.rounds):
                # alternate engines per batch in ABBA order, so linear drift of the machine cancels
                first, second = (base, spec) if j % 2 == 0 else (spec, base)
                o1, t1 = _run(first, prompts[i:i + batch], sps[i:i + batch], batch, fresh)
                o2, t2 = _run(second, prompts[i:i + batch], sps[i:i + batch], batch, fresh)
                (ob, t_b), (os_, t_s) = ((o1, t1), (o2, t2)) if first is base else ((o2, t2), (o1, t1))
                tb, ts = tb + t_b, ts + t_s
                n_b, n_s = sum(len(o["output_ids"]) for o in ob), sum(len(o["output_ids"]) for o in os_)
                if n_b and t_b > 0 and t_s > 0:
                    pairs.append((n_s / t_s) / (n_b / t_b))
                for key, o, t in (("base", ob, t_b), ("spec", os_, t_s)):
                    n_d, t_d = _decode_part(o, t)
                    dec[key][0] += n_d
                    dec[key][1] += t_d
                nb += sum(len(o["output_ids"]) for o in ob)
                ns += sum(len(o["output_ids"]) for o in os_)
                same += sum(x["output_ids"] == y["output_ids"] for x, y in zip(ob, os_))
                for o in os_:
                    m = o["meta_info"]
                    steps += m.get("spec_verify_ct", 0)
                    verified += m.get("spec_accepted_tokens", 0) + m.get("spec_verify_ct", 0)
            r = {"batch": batch, "requests": len(prompts) * a.rounds, "base_tok_s": nb / tb, "spec_tok_s": ns / ts,
                 "speedup": (ns / ts) / (nb / tb),
                 "decode_speedup": (dec["spec"][0] / dec["spec"][1]) / max(dec["base"][0] / dec["base"][1], 1e-9),
                 "accept_length": verified / steps if steps else 0.0,
                 "identical": f"{same}/{len(prompts) * a.rounds}", "tokens": [nb, ns]}
            r["pair_ratios"] = pairs
            r["speedup_median"] = statistics.median(pairs) if pairs else r["speedup"]
            results[name] = r
            print(f"{name:14s} batch {batch:2d}: base {r['base_tok_s']:7.1f} tok/s  spec {r['spec_tok_s']:7.1f} "
                  f"tok/s  x{r['speedup']:.2f}  decode x{r['decode_speedup']:.2f}  accept length {r['accept_length']:.2f}  identical {r['identical']}"
                  f"  median x{r['speedup_median']:.2f} [{min(pairs, default=0):.2f}-{max(pairs, default=0):.2f}, n={len(pairs)}]",
                  flush=True)
    finally:
        base.shutdown()
        spec.shutdown()
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the default model)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: auto)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each engine (tokens; default: %(default)s)")
    p.add_argument("--speculative-algorithm", default="NGRAM", choices=("NGRAM", "STANDALONE"),
                   help="the spec engine's algorithm (default: %(default)s)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=8, help="most draft tokens per step (default: %(default)s)")
    p.add_argument("--speculative-draft-model-path", default=None, help="draft model (STANDALONE)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=4, help="requests per batch-1 workload (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="passes over each workload, engine order alternating (default: %(default)s)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="the spec engine's batch limit for drafting (default: the engine's)")
    p.add_argument("--workloads", nargs="*", default=None,
                   help="subset of copy_edit extract_json extract_sentences chat chat_batch16 chat_heldout "
                        "copy_edit_heldout (default: all)")
    p.add_argument("--reuse-cache", action="store_true",
                   help="keep the radix cache between batches (rounds then reuse cached prompts); default: "
                        "every batch starts on an empty cache")
    p.add_argument("--speculative-verify", default="token", choices=("token", "block"),
                   help="the spec engine's verifier (block: unseeded sampled requests only; default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s: greedy)")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="seed request k with this + k (sampled runs; seeded outputs equal the plain engine's; "
                        "default: unseeded)")
    p.add_argument("--batch-sizes", nargs="*", type=int, default=None,
                   help="add a chat_batch<B> workload per size (max(B, 4) open questions in batches of B: the batch sweep; default: none)")
    p.add_argument("--output-json", default=None, help="write the results here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    res = run(a)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
