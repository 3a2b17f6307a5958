"""Float64 ground truth for the numerics tests, computed independently of the code under test:
plain softmax attention through autograd on the same (16-bit) input values."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def dropout_scale(dropout_p: float) -> float:
    """1 / (1 − p̂), the scale of the kept attention weights: p̂ = min(round(p · 2⁸), 2⁸ − 1) / 2⁸
    (round half to even) is the probability with which the 8-bit keep test drops a weight, as
    docs/architecture.md states it, written out here (so E[keep] · scale = 1)."""
    return 1.0 / (1.0 - min(round(float(dropout_p) * 2**8), 2**8 - 1) / 2**8)


def attention_fp64(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, softmax_scale: float, causal: bool, key_mask: Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, visible: Tensor | None = None,
    keep: Tensor | None = None, dropout_p: float = 0.0,
):
    """Return o, dq, dk, dv (float64) and dS = P ∘ (dP − D) (batch, nheads, Nq, Nk) in float64.

    Layout (batch, seqlen, nheads, headdim); GQA by repeating k/v heads; causal bottom-right aligned.
    ``key_mask``: optional boolean (batch, Nk), True = key visible (and-ed with the causal mask).
    ``window_size`` = (left, right): query i sees key j iff i + Nk − Nq − left <= j <= i + Nk − Nq + right
    (−1: unbounded side), written out here from flash-attn's definition. ``softcap`` > 0: logits
    cap · tanh(τ s / cap) (Gemma 2); dS is then the gradient w.r.t. those capped logits. Rows with no
    visible key give 0 (not NaN), as flash-attn.
    ``visible``: optional boolean (Nq, Nk), True = query i sees key j (and-ed with the others).
    ``keep``, ``dropout_p``: attention dropout with an explicit boolean keep mask (batch, nheads, Nq, Nk):
    o = (P ∘ keep / (1 − p̂)) V, p̂ the drop probability of the 8-bit keep test (:func:`dropout_scale`).
    dS is still taken w.r.t. the undropped P (its gradient dP flows back through the mask), i.e.
    dS = P ∘ (dP − Σ_j P dP).
    """
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), -math.inf)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    if window_size[0] >= 0:
        s = s.masked_fill(j < i + nk - nq - window_size[0], -math.inf)
    if window_size[1] >= 0:
        s = s.masked_fill(j > i + nk - nq + window_size[1], -math.inf)
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], -math.inf)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    # A fully masked row: softmax gives NaN; its output and gradients are 0 (masked_fill keeps the graph finite).
    empty = torch.isinf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    p.retain_grad()
    pv = p if keep is None else p * keep.double() * dropout_scale(dropout_p)
    o = torch.einsum("bhij,bjhd->bihd", pv, vv)
    o.backward(do.double())
    dp = p.grad
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    return o.detach(), q.grad, k.grad, v.grad, ds.detach()


def packed_visible(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool,
                   window_size: tuple[int, int] = (-1, -1)) -> Tensor:
    """(total_q, total_k) boolean: packed query i sees packed key j iff both belong to sequence b and
    (if causal) j − cu_k[b] <= i − cu_q[b] + n_k − n_q — written out over all token pairs, without
    splitting the tensors by sequence (an independent formulation of the varlen mask). ``window_size``
    = (left, right), flash-attn's, in the same local positions: lj >= li + n_k − n_q − left and
    lj <= li + n_k − n_q + right (−1: unbounded side)."""
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    i = torch.arange(int(cq[-1]))[:, None]
    j = torch.arange(int(ck[-1]))[None, :]
    seq_i = (i >= cq[None, 1:]).sum(dim=-1, keepdim=True)  # sequence of row i (empty ones skipped)
    seq_j = (j.T >= ck[None, 1:]).sum(dim=-1, keepdim=True).T
    li, lj = i - cq[seq_i], j - ck[seq_j]
    nq, nk = (cq[1:] - cq[:-1])[seq_i], (ck[1:] - ck[:-1])[seq_j]
    seen = seq_i == seq_j
    if causal:
        seen = seen & (lj <= li + nk - nq)
    if window_size[0] >= 0:
        seen = seen & (lj >= li + nk - nq - window_size[0])
    if window_size[1] >= 0:
        seen = seen & (lj <= li + nk - nq + window_size[1])
    return seen


def packed_attention_fp64(q, k, v, do, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
                          window_size=(-1, -1), softcap=0.0, keep=None, dropout_p=0.0):
    """o, dq, dk, dv (float64) of packed (total, nheads, headdim) tensors: one float64 attention over
    all packed tokens under :func:`packed_visible` (``softcap``, ``keep`` (1, nheads, total_q, total_k),
    ``dropout_p`` as :func:`attention_fp64`)."""
    vis = packed_visible(cu_seqlens_q, cu_seqlens_k, causal, window_size)
    o, dq, dk, dv, _ = attention_fp64(q[None], k[None], v[None], do[None], softmax_scale, False, visible=vis,
                                      softcap=softcap, keep=keep, dropout_p=dropout_p)
    return o[0], dq[0], dk[0], dv[0]


def head_error(x: Tensor, ref: Tensor) -> Tensor:
    """Per-(batch, head) relative Frobenius error ‖x − ref‖_F / ‖ref‖_F (DESIGN.md §6), float64."""
    x = x.double()
    return (x - ref).norm(dim=(1, 3)) / ref.norm(dim=(1, 3))


def median_head_error(x: Tensor, ref: Tensor) -> float:
    return head_error(x, ref).median().item()
