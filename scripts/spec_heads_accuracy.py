"""Top-1 / top-k accuracy of the EAGLE draft head per draft depth, against the target's greedy
tokens, on the held-out open chat questions (``sglite bench spec``'s ``chat`` + ``chat_heldout``).

    python scripts/spec_heads_accuracy.py [--heads DIR] [--num-prompts 16] [--new-tokens 64]
        [--topk 1 4] [--depths 3] [--train-data data.pt --train-seqs 16]

The target (the engine's default dtype and quantization, as served) generates greedy answers,
keeping every position's final-normed feature ``f_t`` (:func:`sglite.train_draft.generate`).
The head then runs as the EAGLE proposer runs it (:mod:`sglite.runtime.speculative.head_proposer`):
its K/V over the real features ``(f_i, x_{i+1})`` of positions before ``t``, then

* depth 1: input ``(f_{t-1}, x_t)`` (real feature, as the catch-up's last row) -> ``g_t``, whose
  LM-head logits are scored against the target's token ``x_{t+1}``;
* depth d > 1: input ``(g_{t+d-2}, x_{t+d-1})`` (the head's *own* predicted feature, the correct
  token: the path the verifier accepts) -> ``g_{t+d-1}``, scored against ``x_{t+d}``, attending to
  the real rows before ``t`` and the path's earlier draft rows (the tree mask).

Reports, per depth, the fraction of positions whose target token is the head's top-1 / in its
top-k (over the draft vocabulary the heads ship; ``vocab`` is the fraction of target tokens in it:
a ceiling for every depth), and the chained top-1 accept length a single chain of ``depths``
drafts would reach (1 + expected accepted prefix). ``--train-data`` also scores a few training
sequences (``sglite train-draft --data``): a gap between the two is overfitting.
"""
from __future__ import annotations

import argparse

import torch


def depth_accuracy(head, model, seqs, vocab: torch.Tensor, depths: int, topk: list[int]) -> dict:
    """``seqs``: per sequence ``(tokens [T] int64, feats [T-1, H] float32)`` from the target's greedy
    generation; scored positions: those ``t`` with a next token (whole sequence, prompt included
    only after ``start``). Returns ``{"n": positions, "vocab": frac, "chain": accept length,
    d: {k: frac}}``."""
    w = model.lm_head.rows(vocab, torch.float32) if hasattr(model.lm_head, "rows") else model.lm_head.weight[vocab].float()
    in_vocab = torch.zeros(model.arch.vocab_size, dtype=torch.bool)
    in_vocab[vocab] = True
    hits = {d: {k: 0 for k in topk} for d in range(1, depths + 1)}
    n_all, n_voc, chain_acc = 0, 0, 0.0
    for x, f, start in seqs:
        T = f.shape[0]  # features of positions 0..T-1; tokens 0..T
        if max(1, start) > T - depths:
            continue
        emb = model.embed_rows(x[1:T + 1]).float()[None]  # [1, T, H]: x_{i+1} for row i
        pos = torch.arange(T)[None]
        real, (rk, rv) = head(emb, f[None], pos)  # row i: (f_i, x_{i+1}) -> g_{i+1}
        ts = torch.arange(max(1, start), T - depths + 1)  # t: pending position; needs x_{t+depths}
        n = ts.numel()
        g = real[0, ts - 1]  # depth 1: g_t from the real row t-1
        ok = torch.ones(n, dtype=torch.bool)
        pk, pv = [rk], [rv]
        for d in range(1, depths + 1):
            tgt = x[ts + d]
            lg = g @ w.T  # [n, Vd]
            top = vocab[lg.topk(max(topk), dim=-1).indices]  # [n, K]
            for k in topk:
                hits[d][k] += int((top[:, :k] == tgt[:, None]).any(-1).sum())
            ok = ok & (top[:, 0] == tgt)
            chain_acc += float(ok.sum())
            if d == 1:
                n_all += n
                n_voc += int(in_vocab[x[ts + 1]].sum())
            if d == depths:
                break
            # next depth: (g, x_{t+d}) at position t+d-1, over real rows < t and this path's draft rows
            P = T + (d - 1) * n
            mask = torch.zeros(n, P + n, dtype=torch.bool)
            mask[:, :T] = torch.arange(T)[None] < ts[:, None]
            for j in range(d - 1):
                mask[torch.arange(n), T + j * n + torch.arange(n)] = True
            mask[torch.arange(n), P + torch.arange(n)] = True
            e = model.embed_rows(x[ts + d]).float()[None]
            out, (k_, v_) = head(e, g[None], (ts + d - 1)[None],
                                 (torch.cat(pk, 1), torch.cat(pv, 1)), mask)
            pk.append(k_)
            pv.append(v_)
            g = out[0]
    res = {"n": n_all, "vocab": n_voc / max(1, n_all), "chain": 1 + chain_acc / max(1, n_all)}
    for d in hits:
        res[d] = {k: hits[d][k] / max(1, n_all) for k in topk}
    return res


def main() -> None:
    from sglite.bench.spec import CHAT, heldout
    from sglite.runtime.speculative.heads import default_heads_dir, load_heads
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.train_draft import generate, make_runner

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=None, help="EAGLE head folders (default: the shipped heads)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--topk", type=int, nargs="+", default=[1, 4])
    p.add_argument("--depths", type=int, default=3)
    p.add_argument("--train-data", default=None, help="a train-draft --data file: also score its first sequences")
    p.add_argument("--train-seqs", type=int, default=16)
    p.add_argument("--dtype", default=None, help="target dtype (default: the engine's)")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    runner, ckpt = make_runner(None, 16 * 2 * (256 + a.new_tokens) + 64, **({"dtype": a.dtype} if a.dtype else {}))
    model = runner.model
    tok = Tokenizer.from_dir(ckpt.model_dir, ckpt.hf_config)
    qs = (CHAT + heldout()["chat"])[:a.num_prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False) for q in qs]
    eos = {int(e) for e in (ckpt.hf_config.eos_token_id if isinstance(ckpt.hf_config.eos_token_id, list)
                            else [ckpt.hf_config.eos_token_id]) if e is not None}
    held = [(x, f, len(pr)) for (x, f), pr in zip(generate(runner, prompts, a.new_tokens, 16, eos), prompts)]
    sets = {"held-out": held}
    if a.train_data:
        data = torch.load(a.train_data)[:a.train_seqs]
        # score the generated part only: after the last prompt position whose label is not the next token
        sets["train"] = [(x, f, int((y[:f.shape[0]] != x[1:f.shape[0] + 1]).nonzero().max()) + 1) for x, f, y in data]
    for hd in a.heads or [str(default_heads_dir("eagle"))]:
        head, vocab = load_heads(hd, model.arch.hidden_size, model.arch.vocab_size, "eagle")
        if vocab is None:
            vocab = torch.arange(model.arch.vocab_size)
        for name, seqs in sets.items():
            r = depth_accuracy(head, model, seqs, vocab, a.depths, a.topk)
            cells = "  ".join(f"d{d}: " + "/".join(f"{r[d][k]:.3f}" for k in a.topk) for d in range(1, a.depths + 1))
            print(f"{hd} [{name}] {r['n']} positions, vocab {r['vocab']:.3f}, top-{'/'.join(map(str, a.topk))}  "
                  f"{cells}  chain-{a.depths} accept length {r['chain']:.2f}")


if __name__ == "__main__":
    main()
