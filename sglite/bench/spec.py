"""``sglite bench spec``: decode speed with and without speculative decoding, side by side.

Engines on the same model in one process: one without speculation, and one per
``--speculative-algorithm`` (NGRAM, STANDALONE, EAGLE, MEDUSA; EAGLE / MEDUSA load the heads
shipped for the default model unless ``--speculative-draft-model-path ALG=DIR`` names others) and
per ``--speculative-verify`` (``token block``: block vs token verification side by side; they
differ on sampled requests only). Every request runs on all of them, the order rotating per
batch, so machine drift hits all alike. Workloads:

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


ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "MEDUSA")
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


def _draft_paths(a: argparse.Namespace) -> dict:
    """``--speculative-draft-model-path`` values -> ``{algorithm: path}``: ``ALG=PATH`` names one
    algorithm; a bare ``PATH`` goes to every named algorithm that takes one (all but NGRAM)."""
    out: dict = {}
    for v in a.speculative_draft_model_path or []:
        alg, sep, path = v.partition("=")
        if sep and alg.upper() in ALGORITHMS:
            out[alg.upper()] = path
        else:
            out.update({x: v for x in a.speculative_algorithm if x != "NGRAM"})
    return out


def spec_engines(a: argparse.Namespace, kw: dict) -> dict:
    """``label -> Engine``: one engine per (algorithm, verifier) of ``a``; the label is the
    algorithm, with ``/<verify>`` when more than one verifier is compared."""
    from sglite import Engine

    extra = {k: v for k, v in dict(speculative_disable_by_batch_size=a.speculative_disable_by_batch_size,
                                   speculative_num_steps=a.speculative_num_steps,
                                   speculative_eagle_topk=a.speculative_eagle_topk).items() if v}
    paths = _draft_paths(a)
    out = {}
    for alg in a.speculative_algorithm:
        for ver in a.speculative_verify:
            label = alg + (f"/{ver}" if len(a.speculative_verify) > 1 else "")
            out[label] = Engine(**kw, **extra, speculative_algorithm=alg, speculative_verify=ver,
                                speculative_num_draft_tokens=a.speculative_num_draft_tokens,
                                **({"speculative_draft_model_path": paths[alg]} if alg in paths else {}))
    return out


def _summary(name: str, batch: int, n_req: int, acc: dict, base: dict) -> dict:
    """One (workload, spec engine) result from the accumulated ``acc`` and ``base`` counters."""
    pairs = acc["pairs"]
    return {"batch": batch, "requests": n_req, "base_tok_s": base["n"] / base["t"], "spec_tok_s": acc["n"] / acc["t"],
            "speedup": (acc["n"] / acc["t"]) / (base["n"] / base["t"]),
            "decode_speedup": (acc["dn"] / acc["dt"]) / max(base["dn"] / base["dt"], 1e-9),
            "accept_length": acc["verified"] / acc["steps"] if acc["steps"] else 0.0,
            "identical": f"{acc['same']}/{n_req}", "tokens": [base["n"], acc["n"]], "pair_ratios": pairs,
            "speedup_median": statistics.median(pairs) if pairs else (acc["n"] / acc["t"]) / (base["n"] / base["t"])}


def run(a: argparse.Namespace) -> dict:
    """Run the workloads on the plain engine and every spec engine (:func:`spec_engines`).
    Returns ``{workload: result}`` with one spec engine, ``{"<workload> <label>": result}`` with
    several (result fields: :func:`_summary`)."""
    from sglite import Engine

    kw = {k: v for k, v in dict(model_path=a.model_path, dtype=a.dtype, max_total_tokens=a.max_total_tokens,
                                max_running_requests=16).items() if v is not None}
    base = Engine(**kw)
    specs: dict = {}
    results = {}
    try:
        specs = spec_engines(a, kw)
        for name, (items, batch) in workloads(a.num_prompts, a.batch_sizes or ()).items():
            if a.workloads and name not in a.workloads:
                continue
            prompts = [base.apply_chat_template([{"role": "user", "content": m}]) for m, _ in items]
            sps = [{"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, **x,
                    **({"sampling_seed": a.sampling_seed + k} if a.sampling_seed is not None else {})}
                   for k, (_, x) in enumerate(items)]
            fresh = not a.reuse_cache
            engines = {"base": base, **specs}
            for e in engines.values():  # warm all (kernels, grammar caches)
                _run(e, prompts[:1], sps[:1], 1)
            acc = {k: {"n": 0, "t": 0.0, "dn": 0, "dt": 0.0, "same": 0, "steps": 0, "verified": 0, "pairs": []}
                   for k in engines}
            labels = list(engines)
            for j, i in enumerate(list(range(0, len(prompts), batch)) * a.rounds):
                # rotate the engines' order per batch (ABBA with two), so drift of the machine spreads over all
                order = labels[j % len(labels):] + labels[:j % len(labels)] if len(labels) > 2 else \
                    (labels if j % 2 == 0 else labels[::-1])
                got = {k: _run(engines[k], prompts[i:i + batch], sps[i:i + batch], batch, fresh) for k in order}
                ob, t_b = got["base"]
                n_b = sum(len(o["output_ids"]) for o in ob)
                for k, (outs, t) in got.items():
                    c = acc[k]
                    n = sum(len(o["output_ids"]) for o in outs)
                    c["n"], c["t"] = c["n"] + n, c["t"] + t
                    n_d, t_d = _decode_part(outs, t)
                    c["dn"], c["dt"] = c["dn"] + n_d, c["dt"] + t_d
                    if k == "base":
                        continue
                    if n_b and t_b > 0 and t > 0:
                        c["pairs"].append((n / t) / (n_b / t_b))
                    c["same"] += sum(x["output_ids"] == y["output_ids"] for x, y in zip(ob, outs))
                    for o in outs:
                        m = o["meta_info"]
                        c["steps"] += m.get("spec_verify_ct", 0)
                        c["verified"] += m.get("spec_accepted_tokens", 0) + m.get("spec_verify_ct", 0)
            for label in specs:
                r = _summary(name, batch, len(prompts) * a.rounds, acc[label], acc["base"])
                results[name if len(specs) == 1 else f"{name} {label}"] = r
                pairs = r["pair_ratios"]
                tag = "" if len(specs) == 1 else f" {label:14s}"
                print(f"{name:14s}{tag} batch {batch:2d}: base {r['base_tok_s']:7.1f} tok/s  spec {r['spec_tok_s']:7.1f} "
                      f"tok/s  x{r['speedup']:.2f}  decode x{r['decode_speedup']:.2f}  accept length {r['accept_length']:.2f}"
                      f"  identical {r['identical']}  median x{r['speedup_median']:.2f} "
                      f"[{min(pairs, default=0):.2f}-{max(pairs, default=0):.2f}, n={len(pairs)}]", flush=True)
    finally:
        base.shutdown()
        for e in specs.values():
            e.shutdown()
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the default model)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: auto)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each engine (tokens; default: %(default)s)")
    p.add_argument("--speculative-algorithm", nargs="+", default=["NGRAM"], choices=ALGORITHMS,
                   help="the spec engines' algorithms, one engine each, all beside the one plain engine "
                        "(EAGLE / MEDUSA: the heads shipped for the default model unless a path is given; "
                        "default: %(default)s)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=8, help="most draft tokens per step (default: %(default)s)")
    p.add_argument("--speculative-draft-model-path", nargs="*", default=None,
                   help="draft model (STANDALONE) or head folder (EAGLE / MEDUSA): ALG=PATH for one algorithm, "
                        "a bare PATH for every named algorithm but NGRAM")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft depth (STANDALONE / EAGLE; default: the engine's)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="EAGLE: branching of the draft tree (default: the engine's)")
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
    p.add_argument("--speculative-verify", nargs="+", default=["token"], choices=("token", "block"),
                   help="the spec engines' verifiers: both names compare them, one engine per algorithm and "
                        "verifier (block: unseeded sampled requests only, greedy ones verify per token; "
                        "default: %(default)s)")
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
