"""Tiny attention models and an independent attention reference shared by test_swap/test_plugin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _fp64 import dropout_scale


def reference_attn(q, k, v, softmax_scale=None, causal=False, fix="gproj", dropout_p=0.0, stats_name=None,
                   window_size=(-1, -1), softcap=0.0, keep=None):
    """Plain softmax attention, written out (no SDPA): (batch, seqlen, nheads, headdim) layout, GQA
    by repeating k/v heads, causal bottom-right aligned (j <= i + Nk - Nq), flash-attn's window
    i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1 or None: unbounded), softcap
    cap·tanh(s/cap) on the scaled scores, rows with no visible key give 0. ``dropout_p`` > 0 needs the
    boolean keep mask ``keep`` (batch, nheads, Nq, Nk): P ∘ keep / (1 − p̂) multiplies v (p̂ the
    rounded p, _fp64.dropout_scale)."""
    if dropout_p > 0 and keep is None:
        raise ValueError("dropout_p > 0 needs the keep mask")
    n_q, h, d = q.shape[1], q.shape[2], q.shape[3]
    n_k, h_k = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // h_k, dim=2)
    v = v.repeat_interleave(h // h_k, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~visible, float("-inf"))
    i = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=q.device)[None, :]
    left, right = (-1 if x is None else x for x in window_size)
    if left >= 0:
        s = s.masked_fill(j < i - left, float("-inf"))
    if right >= 0:
        s = s.masked_fill(j > i + right, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout_p > 0:
        p = p * keep.to(p.dtype) * dropout_scale(dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def op_keep_mask(seed: int, dropout_p: float, batch: int, nheads: int, n_q: int, n_k: int,
                 cu_seqlens: tuple | None = None) -> torch.Tensor:
    """The keep mask the op's next dense call draws after ``torch.manual_seed(seed)`` (ops._draw_rng: one
    signed int64 from torch's CPU generator, offset 0): (batch, nheads, n_q, n_k) bool. With
    ``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k), a varlen call's mask (:func:`packed_keep_mask`;
    batch = 1, n_q, n_k the packed totals)."""
    from lightning_gproj.kernels.reference import dropout_keep_mask

    torch.manual_seed(seed)
    op_seed = int(torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64))
    if cu_seqlens is not None:
        return packed_keep_mask(op_seed, 0, dropout_p, nheads, *cu_seqlens)
    return dropout_keep_mask(op_seed, 0, dropout_p, batch, nheads, n_k, (0, n_q), (0, n_k))


def packed_keep_mask(seed: int, offset: int, dropout_p: float, nheads: int, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
    """The keep mask of packed sequences as a (1, nheads, total_q, total_k) bool over the packed tokens,
    for float64 attention under a packed visibility mask: sequence b's block is
    ``dropout_keep_mask`` of its packed query rows and its own keys 0 .. n_k − 1 (n_k = total_k),
    False outside the sequences' blocks (pairs no query sees)."""
    from lightning_gproj.kernels.reference import dropout_keep_mask

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    keep = torch.zeros(1, nheads, cq[-1], ck[-1], dtype=torch.bool)
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        keep[:, :, q0:q1, k0:k1] = dropout_keep_mask(seed, offset, dropout_p, 1, nheads, ck[-1], (q0, q1), (0, k1 - k0))
    return keep


class OpSpy:
    """Records the keyword arguments of every op call, then runs the op."""

    def __init__(self, op):
        self.op = op
        self.calls: list[dict] = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(dict(
            kwargs, q_shape=tuple(q.shape), k_shape=tuple(k.shape), q_dtype=q.dtype, dtypes=(q.dtype, k.dtype, v.dtype),
            autocast=torch.is_autocast_enabled(q.device.type)))
        return self.op(q, k, v, **kwargs)


@pytest.fixture
def op_spy(monkeypatch) -> OpSpy:
    """Spy on ``lightning_gproj.ops.gproj_attn_func`` (the real op)."""
    import lightning_gproj.ops as ops

    spy = OpSpy(ops.gproj_attn_func)
    monkeypatch.setattr(ops, "gproj_attn_func", spy)
    return spy


class Projections(nn.Module):
    """q, k, v and output projections (no attention of its own)."""

    def __init__(self, dim=32, heads=4, kv_heads=None, **sdpa_kwargs):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.sdpa_kwargs = sdpa_kwargs

    def qkv(self, x, memory=None):
        """(batch, nheads, seqlen, headdim) q, k, v."""
        b, n, _ = x.shape
        src = x if memory is None else memory
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(src).view(b, src.shape[1], 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v


class SDPAAttention(Projections):
    """F.scaled_dot_product_attention with configurable arguments between the projections."""

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        src = x if memory is None else memory
        q, k, v = self.qkv(x, memory)
        kwargs = {key: (val(n, src.shape[1], x.device) if callable(val) else val) for key, val in self.sdpa_kwargs.items()}
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class HelperMethodAttention(Projections):
    """Calls SDPA from a helper method of its class (found by the class scan)."""

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(self._attend(q, k, v).transpose(1, 2).reshape(b, n, -1))

    def _attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _external_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ExternalHelperAttention(Projections):
    """Calls SDPA through a module-level function (as Hugging Face does): only a catch-all sees it."""

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(_external_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        a = self.norm(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            n = x.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device, dtype=x.dtype)
            a = self.attn(a, a, a, need_weights=False, attn_mask=mask, is_causal=True)[0]
        else:
            a = self.attn(a)
        x = x + a
        return x + self.mlp(x)


class TinyModel(nn.Module):
    """Two blocks: one SDPA (causal), one nn.MultiheadAttention (causal, batch_first)."""

    def __init__(self, dim=32, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([
            Block(SDPAAttention(dim, is_causal=True), dim),
            Block(nn.MultiheadAttention(dim, 4, batch_first=True), dim),
        ])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def logits_and_grads(model: nn.Module, real: torch.Tensor | None = None, **inputs) -> tuple[torch.Tensor, dict]:
    """A Hugging Face model's logits and parameter gradients for a fixed cotangent cos(0, 1, 2, ...),
    zero at the positions where ``real`` (batch, seqlen) is False (padding tokens, whose rows two
    attentions may fill differently)."""
    for p in model.parameters():
        p.grad = None
    out = model(**inputs).logits
    cot = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    out.backward(cot if real is None else cot * real[..., None])
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
