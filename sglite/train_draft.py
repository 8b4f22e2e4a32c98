"""``sglite train-draft``: EAGLE or Medusa draft heads for a model, by self-distillation on CPU.

1. **Data.** Prompts are cut from a local text (``--text``: a file; one prompt per line with
   ``--prompts``; default: the perplexity table's text, :func:`sglite.eval.perplexity.topics_text`),
   wrapped as chat turns (``--no-chat``: raw text). The target generates greedy continuations
   (batched, its own :class:`~sglite.runtime.model_runner.ModelRunner` in the engine's default
   dtype and quantization, so the features are the ones served); every position's final-normed
   hidden state and the target's own greedy next token (the teacher label) are kept.
2. **Training** (AdamW, float32, warm-up then cosine decay to a tenth of ``--lr``, a ``tqdm`` bar;
   ``--train-minutes`` stops it early). EAGLE (Li et al. 2024, §3): from
   ``(embed(x_{t+1}), f_t)`` predict ``f_{t+1}`` (smooth L1) and its token (cross-entropy through
   the target's LM head against the target's distribution on ``f_{t+1}``, ``--labels soft``, or its
   greedy token, ``hard``; weight ``--cls-weight``); ``--ttt-steps`` adds passes on the head's own
   predicted features, masked as the proposer's tree (:func:`draft_passes`). Medusa (Cai et al. 2024, §2.2.1, Medusa-1):
   head ``k`` on ``f_t`` predicts the target's token at ``t + 1 + k`` (cross-entropy, weight
   ``0.8^k``), residual blocks zero-initialised. Logits are over a *draft vocabulary*: the
   ``--draft-vocab`` most frequent teacher tokens (saved with the heads; drafting is then cheap).
3. **Output** (``--output DIR``): ``config.json`` + ``model.safetensors`` (the published layouts,
   :mod:`sglite.runtime.speculative.heads`), ``loss.png`` (the loss curve), ``train_report.json``
   (settings, seconds per phase, losses, acceptance).
4. **Acceptance**: an engine with the new heads decodes the held-back prompts greedily (batch 1);
   the mean tokens per verify step (SGLang's accept length, bonus token included) is reported.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
from torch.nn import functional as F

log = logging.getLogger("sglite.train_draft")

CHAT_ASK = "Explain this passage from the Python documentation in your own words:\n\n"


def make_prompts(tok, text: str, n: int, prompt_tokens: int, chat: bool, lines: bool = False) -> list[list[int]]:
    """``n`` prompts (token ids) from ``text``: its lines (``lines``, each a user turn as it is) or
    consecutive slices of ``prompt_tokens`` tokens (a user turn asking to explain the slice); as
    turns of the chat template when ``chat``."""
    if lines:
        pieces = [ln.strip() for ln in text.splitlines() if ln.strip()][:n]
    else:
        ids = tok.encode(text[:n * prompt_tokens * 8], add_special_tokens=False)
        pieces = [tok.decode(ids[i:i + prompt_tokens]) for i in range(0, len(ids) - prompt_tokens + 1, prompt_tokens)][:n]
    if len(pieces) < n:
        raise ValueError(f"--num-prompts: the text gives only {len(pieces)} prompts, asked {n}")
    if not chat:
        return [tok.encode(p, add_special_tokens=False) for p in pieces]
    ask = "" if lines else CHAT_ASK  # a prompts file's lines are the questions themselves
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": ask + p}]), add_special_tokens=False)
            for p in pieces]


def make_runner(model_path, max_tokens: int, **engine_kwargs):
    """The target's runner as the engine's defaults (and ``engine_kwargs``, e.g. ``dtype``) load
    it, with hidden states kept."""
    from .runtime.engine_config import engine_config
    from .runtime.model_loader import load_checkpoint
    from .runtime.model_runner import ModelRunner, resolve_device, resolve_dtype
    from .runtime.quant_loader import load_weights

    cfg = engine_config(model_path=model_path, max_total_tokens=max_tokens, page_size=1, disable_radix_cache=True,
                        **engine_kwargs)
    ckpt = load_checkpoint(model_path)
    device = resolve_device(cfg.device)
    runner = ModelRunner(cfg, ckpt.hf_config, load_weights(ckpt, cfg.quantization, resolve_dtype(cfg.dtype, device), device))
    if not getattr(runner.model, "emits_hidden", False):
        raise ValueError(f"model_path: {model_path} is not a Llama-family model (no hidden states for heads)")
    runner.keep_hidden = True
    return runner, ckpt


def _forward(dm, rows) -> tuple[list[int], list[torch.Tensor]]:
    """One batched forward of ``(state, n)`` rows: greedy next ids and each state's [n, H] hidden."""
    from .runtime.forward_batch import ForwardBatch
    from .runtime.speculative.draft_model import _Row
    from .runtime.step_plan import StepEntry, StepPlan

    plan = StepPlan([StepEntry(_Row(st), n, st.kv_len) for st, n in rows]).layout()
    logits = dm.runner.forward(ForwardBatch.from_plan(plan, dm.runner.req_to_token_pool.req_to_token))
    hid, off, by = dm.runner.last_hidden, 0, {}
    for i, e in enumerate(plan.entries):
        by[id(e.req._st)] = (hid[off:off + e.n], int(logits[i].argmax()))
        off += e.n
    for st, n in rows:
        st.kv_len += n
    return [by[id(st)][1] for st, _ in rows], [by[id(st)][0] for st, _ in rows]


def generate(runner, prompts: list[list[int]], new_tokens: int, batch: int, eos: set, bar=None) -> list[tuple]:
    """Greedy continuations: per prompt ``(tokens [T] int64, features [T - 1, H] float32)`` —
    the feature of every position but the last (generation stops at an EOS token)."""
    from .runtime.speculative.draft_model import DraftModel, _DraftKV

    dm, out = DraftModel(runner, 1), []
    for b in range(0, len(prompts), batch):
        sts, feats = [], []
        for p in prompts[b:b + batch]:
            st = _DraftKV(runner.req_to_token_pool.alloc())
            st.tokens = list(p)
            if not dm._reserve(st, len(p) + new_tokens):
                raise ValueError("the KV pool is too small for --batch prompts")
            sts.append(st)
            feats.append([])
        nxt, hs = _forward(dm, [(st, len(st.tokens)) for st in sts])
        done = [False] * len(sts)
        for j in range(new_tokens):
            live = []
            for i, st in enumerate(sts):
                if done[i]:
                    continue
                feats[i].append(hs[i])
                st.tokens.append(nxt[i])
                done[i] = nxt[i] in eos or j + 1 == new_tokens
                if not done[i]:
                    live.append(i)
            if bar is not None:
                bar.update(len(sts))
            if not live:
                break
            ids, got = _forward(dm, [(sts[i], 1) for i in live])
            for i, t, h in zip(live, ids, got):
                nxt[i], hs[i] = t, h
        for st, f in zip(sts, feats):
            out.append((torch.tensor(st.tokens), torch.cat(f)))
            dm._free(st)
    return out


def teacher_labels(model, feats: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """The target's greedy token after each position: argmax of its LM head on ``feats`` [T, H]."""
    from . import kernels

    out = [kernels.linear(feats[i:i + chunk].to(model.dtype), model.lm_head).float().argmax(-1)
           for i in range(0, feats.shape[0], chunk)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def _windows(n: int, width: int) -> list[int]:
    starts = list(range(0, max(1, n - width + 1), width))
    if n > width and starts[-1] + width < n:
        starts.append(n - width)
    return starts


def build_head(method: str, model, args):
    """Fresh, untrained draft heads for ``model`` (``method``: ``eagle`` | ``medusa``) with the
    sizes of ``args``, float32."""
    from .runtime.speculative.heads import EagleHead, MedusaHeads

    a = model.arch
    if method == "medusa":
        m = MedusaHeads({"hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "medusa_num_heads": args.medusa_heads})
        for b in m.blocks:
            torch.nn.init.zeros_(b.weight)
            torch.nn.init.zeros_(b.bias)
        return m
    return EagleHead({"hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
                      "intermediate_size": args.intermediate_size or a.intermediate_size,
                      "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,
                      "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "fc_bias": True})


def train(method: str, head, model, data: list[tuple], vocab: torch.Tensor, args, bar=None) -> list[float]:
    """Train ``head`` on ``data`` (per sequence: tokens, features, teacher labels). Returns the
    loss of every step."""
    V = model.arch.vocab_size
    to_draft = torch.full((V,), -100, dtype=torch.int64)
    to_draft[vocab] = torch.arange(len(vocab))
    w_d = (model.lm_head.rows(vocab, torch.float32) if hasattr(model.lm_head, "rows")
           else model.lm_head.weight[vocab].float()).contiguous()  # [Vd, H]
    windows = [(i, s) for i, (x, f, y) in enumerate(data) for s in _windows(f.shape[0] - 1, args.window)]
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    head.train()
    t0 = time.perf_counter()
    limit = getattr(args, "train_minutes", None)
    for step in range(args.steps):
        frac = step / max(1, args.steps)  # how far training is: by steps, or by time when limited
        if limit is not None:
            frac = max(frac, (time.perf_counter() - t0) / (60 * limit))
            if frac >= 1:
                break  # out of time: the steps done are the report's steps_done
        # warm-up over 20 steps, then cosine down to a tenth (the peak rate late in training
        # only shakes the weights: 2026-12-06, the longer runs)
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(len(windows), (args.batch,), generator=gen).tolist()
        loss = _eagle_loss(head, model, data, [windows[j] for j in pick], args, w_d, to_draft) if method == "eagle" \
            else _medusa_loss(head, data, [windows[j] for j in pick], args, w_d, to_draft)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    head.eval()
    return losses


def draft_passes(head, embs: list, feat: torch.Tensor, pos: torch.Tensor) -> list:
    """The EAGLE head's outputs over ``len(embs)`` chained passes of a window, as the proposer's
    tree computes them along a path (:mod:`.runtime.speculative.head_proposer`).

    Args:
        head: an :class:`~.runtime.speculative.heads.EagleHead`.
        embs: per pass ``d`` [B, n, H]: the embeddings of ``x_{t+1+d}`` for rows ``t``.
        feat: [B, n, H] the real features ``f_t``; pos: [B, n] int64 positions ``t``.
    Returns:
        per pass [B, n, H]: pass 0 ``g_{t+1}`` from ``(f_t, x_{t+1})``; pass ``d`` from
        ``(g_{t+d}, x_{t+d+1})`` (the previous pass's output, detached) at position ``t + d``,
        attending to pass 0's rows up to ``t`` and its own path's rows of passes 1..d.
    """
    n, outs = feat.shape[1], []
    out, past = feat, None
    for d, emb in enumerate(embs):
        if d == 0:
            out, past = head(emb, feat, pos)
        else:
            mask = torch.cat([torch.ones(n, n, dtype=torch.bool).tril()]
                             + [torch.eye(n, dtype=torch.bool)] * d, dim=1)  # [n, (d + 1) n]
            out, (k, v) = head(emb, out.detach(), pos + d, past, mask)
            past = (torch.cat((past[0], k), 1), torch.cat((past[1], v), 1))
        outs.append(out)
    return outs


def _eagle_loss(head, model, data, wins, args, w_d, to_draft):
    """EAGLE's loss on ``wins`` (``(sequence, start)``). Pass 0: inputs ``(f_t, x_{t+1})`` at
    position ``t`` (real features, with noise) predict ``f_{t+1}`` and its token. ``--ttt-steps
    K`` > 1 adds passes 1..K-1 as the proposer runs them at tree depth ``d + 1``: inputs
    ``(g, x_{t+d+1})`` with ``g`` the previous pass's *predicted* feature (detached), at position
    ``t + d``, attending to the real rows up to ``t`` and the path's own earlier rows (the tree
    mask), predicting ``f_{t+d+1}`` (training-time test: the depths past the first see the head's
    own features, as at inference)."""
    steps = max(1, getattr(args, "ttt_steps", 1))
    soft = getattr(args, "labels", "hard") == "soft"
    embs, feats, tgts, labels, pos = [[] for _ in range(steps)], [], [[] for _ in range(steps)], [[] for _ in range(steps)], []
    for i, s in wins:
        x, f, y = data[i]
        n = max(1, min(args.window, f.shape[0] - steps - s))
        feats.append(f[s:s + n])
        pos.append(torch.arange(s, s + n))
        for d in range(steps):
            with torch.no_grad():
                embs[d].append(model.embed_rows(x[s + 1 + d:s + 1 + d + n]).float())
            tgts[d].append(f[s + 1 + d:s + 1 + d + n])
            labels[d].append(to_draft[y[s + 1 + d:s + 1 + d + n]])
    n = min(e.shape[0] for e in embs[-1])
    cut = lambda ts: torch.stack([t[:n] for t in ts])  # noqa: E731
    f_in = cut(feats)
    f_in = f_in + args.noise * torch.randn_like(f_in)  # EAGLE's feature noise (robust to its own errors)
    total = 0.0
    for d, out in enumerate(draft_passes(head, [cut(e) for e in embs], f_in, cut(pos))):
        f_next = cut(tgts[d])
        reg = F.smooth_l1_loss(out, f_next)
        logp = torch.log_softmax(out @ w_d.T, dim=-1)  # [B, n, Vd]
        if soft:  # the target's distribution on f_{t+1} (EAGLE's p), over the draft vocabulary
            with torch.no_grad():
                p = torch.softmax(f_next @ w_d.T, dim=-1)
            cls = -(p * logp).sum(-1).mean()
        else:
            cls = F.nll_loss(logp.flatten(0, 1), cut(labels[d]).flatten(), ignore_index=-100)
        total = total + reg + args.cls_weight * cls
    return total / steps


def _medusa_loss(head, data, wins, args, w_d, to_draft):
    total = 0.0
    for i, s in wins:
        x, f, y = data[i]
        n = min(args.window, f.shape[0] - s)
        hs = head(f[s:s + n])  # [n, K, H]
        for k in range(hs.shape[1]):
            m = n - (k + 1)
            if m <= 0:
                continue
            lab = to_draft[y[s + k + 1:s + k + 1 + m]]
            total = total + 0.8 ** k * F.cross_entropy(hs[:m, k] @ w_d.T, lab, ignore_index=-100)
    return total / len(wins)


def acceptance(model_path, method: str, heads_dir, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy decoding of ``prompts`` at batch 1 with the heads: mean accept length (tokens per
    verify step, bonus included) and tokens per second with and without them."""
    from .runtime.engine import Engine

    res = {}
    for alg in (None, method.upper()):
        kw = {"speculative_algorithm": alg, "speculative_draft_model_path": str(heads_dir)} if alg else {}
        eng = Engine(model_path, log_level="warning", **kw)
        try:
            t, toks, steps, acc = time.perf_counter(), 0, 0, 0
            for p in prompts:
                o = eng.generate(input_ids=p, sampling_params={"max_new_tokens": new_tokens, "temperature": 0})
                toks += len(o["output_ids"])
                steps += o["meta_info"].get("spec_verify_ct", 0)
                acc += o["meta_info"].get("spec_accepted_tokens", 0)
            res["plain" if alg is None else "spec"] = {"tokens_per_s": toks / (time.perf_counter() - t), "tokens": toks}
            if alg:
                res["accept_length"] = (acc + steps) / steps if steps else 0.0
                res["verify_steps"] = steps
        finally:
            eng.shutdown()
    return res


def plot_losses(losses: list[float], path) -> None:
    """Write the training loss per optimizer step as a PNG line plot to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="step")
    k = max(1, len(losses) // 20)
    if len(losses) >= k:
        smooth = torch.tensor(losses).unfold(0, k, 1).mean(1).tolist()
        ax.plot(range(k, len(losses) + 1), smooth, lw=1.6, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("draft-head training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite train-draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("eagle", "medusa"), required=True, help="which heads")
    p.add_argument("--model-path", default=None, help="the target (HF folder or .gguf; default: the default model)")
    p.add_argument("--output", required=True, help="folder for the heads, loss.png and train_report.json")
    p.add_argument("--text", default=None, help="a local text file (default: the perplexity table's text)")
    p.add_argument("--prompts", action="store_true", help="--text holds one prompt per line")
    p.add_argument("--no-chat", action="store_true", help="raw text prompts (default: user turns of the chat template)")
    p.add_argument("--num-prompts", type=int, default=96, help="training prompts (default: 96)")
    p.add_argument("--held-out", type=int, default=6, help="held-back prompts for the acceptance check (default: 6)")
    p.add_argument("--prompt-tokens", type=int, default=48, help="tokens of text per prompt (default: 48)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per prompt (default: 128)")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts generated together (default: 16)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    p.add_argument("--batch", type=int, default=4, help="windows per step (default: 4)")
    p.add_argument("--window", type=int, default=128, help="positions per window (default: 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--cls-weight", type=float, default=0.5, help="EAGLE: weight of the token loss (default: 0.5)")
    p.add_argument("--labels", choices=("soft", "hard"), default="soft",
                   help="EAGLE: the token loss's target: the target's distribution over the draft vocabulary "
                        "(soft, EAGLE's recipe) or its greedy token (hard) (default: soft)")
    p.add_argument("--ttt-steps", type=int, default=1,
                   help="EAGLE: passes per window; passes after the first read the head's own predicted "
                        "features, as tree depths 2.. do at inference (default: 1)")
    p.add_argument("--noise", type=float, default=0.05, help="EAGLE: std of the noise on input features (default: 0.05)")
    p.add_argument("--medusa-heads", type=int, default=4, help="Medusa: number of heads (default: 4)")
    p.add_argument("--intermediate-size", type=int, default=None, help="EAGLE: MLP width (default: the target's)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size (default: 4096)")
    p.add_argument("--accept-tokens", type=int, default=64, help="tokens per held-back prompt (default: 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="dtype of the saved weights (default: bfloat16)")
    p.add_argument("--data", nargs="+", default=None,
                   help="a .pt file: the generations (tokens, features, labels) are saved there, or read if it "
                        "exists; several existing files: all are read and trained on together")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="stop training after this many minutes; the learning rate then decays by time "
                        "(the steps done are reported; default: none)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    from tqdm import tqdm

    from .eval.perplexity import topics_text
    from .runtime.speculative.heads import save_heads
    from .runtime.tokenizer import Tokenizer

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ttt_steps < 1:
        parser.error(f"--ttt-steps must be at least 1, got {args.ttt_steps}")
    torch.manual_seed(args.seed)
    times, t0 = {}, time.perf_counter()
    n_all = args.num_prompts + args.held_out
    runner, ckpt = make_runner(args.model_path, args.gen_batch * 2 * (args.prompt_tokens * 2 + 64 + args.new_tokens) + 64)
    tok = Tokenizer.from_dir(ckpt.model_dir, ckpt.hf_config)
    text = Path(args.text).read_text() if args.text else topics_text()
    prompts = make_prompts(tok, text, n_all, args.prompt_tokens, not args.no_chat, args.prompts)
    train_p, held = prompts[:args.num_prompts], prompts[args.num_prompts:]
    eos = {int(e) for e in (ckpt.hf_config.eos_token_id if isinstance(ckpt.hf_config.eos_token_id, list)
                            else [ckpt.hf_config.eos_token_id]) if e is not None}
    model = runner.model
    if args.data and len(args.data) > 1 and not all(Path(d).is_file() for d in args.data):
        raise ValueError(f"--data: several files are read only, and {[d for d in args.data if not Path(d).is_file()]} "
                         f"do not exist")
    if args.data and all(Path(d).is_file() for d in args.data):  # generations of earlier runs
        data = [seq for d in args.data for seq in torch.load(d)]
    else:
        with tqdm(total=len(train_p) * args.new_tokens, desc="generate", unit="tok") as bar:
            seqs = generate(runner, train_p, args.new_tokens, args.gen_batch, eos, bar)
        data = [(x, f, teacher_labels(model, f)) for x, f in seqs]
        if args.data:
            torch.save(data, args.data[0])
    times["generate_s"] = time.perf_counter() - t0
    counts = torch.bincount(torch.cat([y for _, _, y in data]), minlength=model.arch.vocab_size)
    vocab = counts.argsort(descending=True)[:min(args.draft_vocab, int((counts > 0).sum()))].sort().values
    head = build_head(args.method, model, args)
    t1 = time.perf_counter()
    with tqdm(total=args.steps, desc=f"train {args.method}", unit="step") as bar:
        losses = train(args.method, head, model, data, vocab, args, bar)
    times["train_s"] = time.perf_counter() - t1
    out = Path(args.output)
    save_heads(head, out, vocab, getattr(torch, args.dtype))
    plot_losses(losses, out / "loss.png")
    del runner, model
    t2 = time.perf_counter()
    acc = acceptance(args.model_path, args.method, out, held, args.accept_tokens) if held else {}
    times["acceptance_s"] = time.perf_counter() - t2
    report = {"method": args.method, "model_path": args.model_path, "args": vars(args), "seconds": times,
              "tokens": sum(int(x.numel()) for x, _, _ in data), "draft_vocab": int(vocab.numel()),
              "steps_done": len(losses),
              "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
              "acceptance": acc}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("seconds", "tokens", "loss_first", "loss_last", "acceptance")}, indent=2))
    return 0
