"""Float64 ground truth for the numerics tests, computed independently of the code under test:
plain softmax attention through autograd on the same (16-bit) input values."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_fp64(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, softmax_scale: float, causal: bool, key_mask: Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
):
    """Return o, dq, dk, dv (float64) and dS = P ∘ (dP − D) (batch, nheads, Nq, Nk) in float64.

    Layout (batch, seqlen, nheads, headdim); GQA by repeating k/v heads; causal bottom-right aligned.
    ``key_mask``: optional boolean (batch, Nk), True = key visible (and-ed with the causal mask).
    ``window_size`` = (left, right): query i sees key j iff i + Nk − Nq − left <= j <= i + Nk − Nq + right
    (−1: unbounded side), written out here from flash-attn's definition. ``softcap`` > 0: logits
    cap · tanh(τ s / cap) (Gemma 2); dS is then the gradient w.r.t. those capped logits. Rows with no
    visible key give 0 (not NaN), as flash-attn.
    """
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~visible, -math.inf)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    if window_size[0] >= 0:
        s = s.masked_fill(j < i + nk - nq - window_size[0], -math.inf)
    if window_size[1] >= 0:
        s = s.masked_fill(j > i + nk - nq + window_size[1], -math.inf)
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], -math.inf)
    # A fully masked row: softmax gives NaN; its output and gradients are 0 (masked_fill keeps the graph finite).
    empty = torch.isinf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    p.retain_grad()
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    o.backward(do.double())
    dp = p.grad
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    return o.detach(), q.grad, k.grad, v.grad, ds.detach()


def head_error(x: Tensor, ref: Tensor) -> Tensor:
    """Per-(batch, head) relative Frobenius error ‖x − ref‖_F / ‖ref‖_F (DESIGN.md §6), float64."""
    x = x.double()
    return (x - ref).norm(dim=(1, 3)) / ref.norm(dim=(1, 3))


def median_head_error(x: Tensor, ref: Tensor) -> float:
    return head_error(x, ref).median().item()
