"""Float64 ground truth for the numerics tests, computed independently of the code under test:
plain softmax attention through autograd on the same (16-bit) input values."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_fp64(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, softmax_scale: float, causal: bool, key_mask: Tensor | None = None,
    visible: Tensor | None = None,
):
    """Return o, dq, dk, dv (float64) and dS = P ∘ (dP − D) (batch, nheads, Nq, Nk) in float64.

    Layout (batch, seqlen, nheads, headdim); GQA by repeating k/v heads; causal bottom-right aligned.
    ``key_mask``: optional boolean (batch, Nk), True = key visible (and-ed with the causal mask).
    ``visible``: optional boolean (Nq, Nk), True = query i sees key j (and-ed with the others).
    """
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * softmax_scale
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~visible, -math.inf)
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], -math.inf)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    p.retain_grad()
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    o.backward(do.double())
    dp = p.grad
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    return o.detach(), q.grad, k.grad, v.grad, ds.detach()


def packed_visible(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool) -> Tensor:
    """(total_q, total_k) boolean: packed query i sees packed key j iff both belong to sequence b and
    (if causal) j − cu_k[b] <= i − cu_q[b] + n_k − n_q — written out over all token pairs, without
    splitting the tensors by sequence (an independent formulation of the varlen mask)."""
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    i = torch.arange(int(cq[-1]))[:, None]
    j = torch.arange(int(ck[-1]))[None, :]
    seq_i = (i >= cq[None, 1:]).sum(dim=-1, keepdim=True)  # sequence of row i (empty ones skipped)
    seq_j = (j.T >= ck[None, 1:]).sum(dim=-1, keepdim=True).T
    same = seq_i == seq_j
    if not causal:
        return same
    li, lj = i - cq[seq_i], j - ck[seq_j]
    nq, nk = (cq[1:] - cq[:-1])[seq_i], (ck[1:] - ck[:-1])[seq_j]
    return same & (lj <= li + nk - nq)


def packed_attention_fp64(q, k, v, do, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k):
    """o, dq, dk, dv (float64) of packed (total, nheads, headdim) tensors: one float64 attention over
    all packed tokens under :func:`packed_visible`."""
    vis = packed_visible(cu_seqlens_q, cu_seqlens_k, causal)
    o, dq, dk, dv, _ = attention_fp64(q[None], k[None], v[None], do[None], softmax_scale, False, visible=vis)
    return o[0], dq[0], dk[0], dv[0]


def head_error(x: Tensor, ref: Tensor) -> Tensor:
    """Per-(batch, head) relative Frobenius error ‖x − ref‖_F / ‖ref‖_F (DESIGN.md §6), float64."""
    x = x.double()
    return (x - ref).norm(dim=(1, 3)) / ref.norm(dim=(1, 3))


def median_head_error(x: Tensor, ref: Tensor) -> float:
    return head_error(x, ref).median().item()
