"""Torch references of the mixture-of-experts ops (:func:`sglite.kernels.moe_topk`,
:func:`sglite.kernels.moe_experts`), re-exported by :mod:`.reference`."""
import torch
import torch.nn.functional as F


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert routing (Shazeer et al. 2017, "Outrageously Large Neural Networks", sec. 2.1):
    softmax over every expert in float32, the ``top_k`` largest kept (``torch.topk``: ties go the
    way transformers' routers break them), renormalised to sum to 1 when ``renormalize``
    (Mixtral always, which equals a softmax over the top-k logits; Qwen-MoE with ``norm_topk_prob``).

    router_logits: [N, E]; returns ``(weights [N, top_k] float32, expert ids [N, top_k] int64)``.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                linear=F.linear, act=None) -> torch.Tensor:
    """Routed SwiGLU experts, grouped by expert: the (token, expert) assignments are sorted by
    expert (stable, so each group's tokens stay in order), then per active expert one gate/up
    matmul over its tokens' rows, the activation, one down matmul, the rows scaled by their
    routing weight and scatter-added into the output (ascending expert order per token, as
    transformers' ``*Experts`` modules sum them).

    x: [N, H]; topk_ids: [N, k] int64 in [0, E); topk_weights: [N, k] (cast to x's dtype);
    gate_up: E weights [2I, H] (gate rows then up rows; a [E, 2I, H] tensor or a sequence of
    whatever ``linear`` takes); down: E weights [H, I]; ``linear(x, w)`` -> ``x @ w.T``;
    ``act(g, u)`` defaults to ``silu(g) * u``. Returns [N, H] in x's dtype.
    """
    out = torch.zeros_like(x)
    n, k = topk_ids.shape
    if n == 0:
        return out
    flat = topk_ids.reshape(-1)  # [N*k]
    order = torch.argsort(flat, stable=True)
    rows_of = order // k  # token row of each sorted assignment
    w = topk_weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for e, c in enumerate(torch.bincount(flat, minlength=len(gate_up)).tolist()):
        if c == 0:
            continue
        rows = rows_of[start:start + c]
        g, u = linear(x[rows], gate_up[e]).chunk(2, dim=-1)  # [c, I] each
        h = act(g, u) if act is not None else F.silu(g) * u
        out.index_add_(0, rows, linear(h, down[e]) * w[start:start + c, None])
        start += c
    return out
