"""Block verification: accept a draft chain jointly (Sun et al. 2024, "Block Verification
Accelerates Speculative Decoding", ICLR 2025, §3 and Algorithm 2).

Token verification (:func:`.verify.verify_chain`) decides each draft token on its own ratio
``p_i(d_i) / q_i(d_i)``. Block verification carries a weight along the block,

    w_0 = 1,    w_i = min(1, w_{i-1} * p_i(d_i) / q_i(d_i)),

so a token the draft under-weights can make up for one it over-weighted before it. With the
residual mass ``r_i = sum_x max(w_i * p_{i+1}(x) - q_{i+1}(x), 0)`` of the position after ``i``
kept tokens, the chance to stop there is ``h_i = r_i / (r_i + 1 - w_i)`` (``h_k = w_k`` for the
whole block, ``h_0 = 1``). The verifier draws one uniform per ``i`` from ``k`` down to 0 and keeps
the first (longest) prefix whose uniform is at most ``h_i``; the next token is drawn from the
normalized residual ``max(w_i p_{i+1} - q_{i+1}, 0)`` (or from ``p_{k+1}`` after the whole block).
The output is distributed exactly as the target's (Theorem 1) and the expected number of kept
tokens is the most any exact verifier reaches (Theorem 2): never fewer than token verification.

For point-mass drafts (every proposer here drafts deterministically) ``w_i = prod p_j(d_j)`` and
``P(at least i kept) = w_i``, the same as token verification: the gain needs drafts sampled from a
distribution ``q``. Forced (jump-forward) tokens are point masses of both models: the weight goes
through unchanged and nothing is ever drawn right before one (``r_i = 0``).

The decisions are joint, so a block's draws cannot be keyed by output position alone (where a
block starts changes the outcome): the decoder runs this verifier for sampled requests without a
``sampling_seed`` only, and seeded requests keep the position-keyed token verifier (exact seeds).
"""
from __future__ import annotations

from typing import Collection, Optional, Sequence

import torch

from sglite import kernels

from .verify import target_probs


def stop_chances(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int]) -> tuple[list[float], list[torch.Tensor]]:
    """The stop probabilities ``h_0 .. h_k`` and residual weights of a block (module docstring).

    Args:
        p: [k+1, V] float target distributions (row ``i``: the token after ``i`` draft tokens).
        q: [k, V] float draft distributions ``q_1 .. q_k`` (rows summing to 1).
        draft: the k draft tokens (``q[i, draft[i]] > 0``).
    Returns:
        (h, residuals): ``h[i]`` in [0, 1] for i = 0 .. k (``h[0] = 1``), and per i < k the
        unnormalized residual ``max(w_i p_{i+1} - q_{i+1}, 0)`` ([V] float, float64 sums).
    """
    k = len(draft)
    w, h, residuals = 1.0, [], []
    for i in range(k):
        res = (w * p[i].double() - q[i].double()).clamp_min(0.0)  # [V]
        r = float(res.sum())
        residuals.append(res)
        h.append(1.0 if i == 0 else (r / (r + 1.0 - w) if r > 0.0 else 0.0))
        q_d = float(q[i, draft[i]])
        w = min(1.0, w * float(p[i, draft[i]]) / q_d) if q_d > 0 else 0.0
    h.append(w if k else 1.0)
    return h, residuals


def verify_block(x: torch.Tensor, draft: Sequence[int], params, generator: Optional[torch.Generator] = None,
                 draft_probs: Optional[torch.Tensor] = None, forced: Collection[int] = ()) -> tuple[list[int], int]:
    """Block verification of one draft chain against the transformed verify rows ``x``
    ([k+1, V] float32, from :func:`.verify.row_logits`).

    Args:
        draft: the k draft tokens ``d_1 .. d_k``.
        params: the request's sampling params (temperature 0: greedy prefix matching, which is
            what block verification reduces to for a deterministic target).
        generator: torch generator of the uniforms and the final draw (sampling only).
        draft_probs: [k, V] the draft distributions ``q_i``; None: point masses on ``draft``.
        forced: indices of draft tokens the grammar forces (kept whenever reached).
    Returns:
        (tokens, accepted): ``accepted`` draft tokens kept plus one token drawn after them.
    """
    k = len(draft)
    if params.temperature <= 1e-6:
        target = kernels.greedy(x).tolist()  # [k+1]
        a = 0
        while a < k and (a in forced or draft[a] == target[a]):
            a += 1
        return list(draft[:a]) + [target[a]], a
    p = target_probs(x, params)  # [k+1, V]
    V = p.shape[1]
    q = torch.zeros(k, V, dtype=p.dtype) if draft_probs is None else draft_probs.to(p.dtype).clone()  # [k, V]
    if draft_probs is None:
        q[torch.arange(k), torch.tensor(list(draft), dtype=torch.int64)] = 1.0
    for i in forced:  # the grammar's forced token: a point mass of both models
        if i < k:
            p[i] = 0.0
            p[i, draft[i]] = 1.0
            q[i] = 0.0
            q[i, draft[i]] = 1.0
    h, residuals = stop_chances(p, q, draft)
    tau = 0
    for i in range(k, 0, -1):
        if float(torch.rand(1, generator=generator)) <= h[i]:
            tau = i
            break
    if tau == k:
        dist = p[k]
    else:
        dist = residuals[tau]
        if float(dist.sum()) <= 0.0:  # rounding: the residual had no mass
            dist = p[tau].double()
    tok = int(torch.multinomial(dist.float(), 1, generator=generator))
    return list(draft[:tau]) + [tok], tau
