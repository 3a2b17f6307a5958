"""Swap ``nn.MultiheadAttention`` for :class:`GProjMultiheadAttention`, keeping every parameter.

The swap changes the instance's ``__class__`` only: parameters (``in_proj_weight``, ``in_proj_bias``,
``out_proj.weight``, ``out_proj.bias``), buffers and state_dict keys stay as they are, so a
checkpoint loads into a plain model with ``strict=True``. ``nn.MultiheadAttention`` has a fast path
(``torch._native_multi_head_attention``) that never reaches SDPA's Python entry, hence a module swap
rather than a ``TorchFunctionMode``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Guard, Site, causal_bool, op_reason


def static_reason(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot be swapped at all (None if it can): properties fixed at construction."""
    if type(module) is not nn.MultiheadAttention and not isinstance(module, GProjMultiheadAttention):
        return f"subclass {type(module).__name__} of nn.MultiheadAttention (its forward may differ)"
    if not module._qkv_same_embed_dim:
        return f"kdim/vdim ({module.kdim}/{module.vdim}) differ from embed_dim {module.embed_dim}"
    if module.bias_k is not None:
        return "add_bias_kv=True"
    if module.add_zero_attn:
        return "add_zero_attn=True"
    return None


def _is_causal_mha_mask(mask: torch.Tensor, n_q: int, n_k: int) -> bool:
    """True if an ``nn.MultiheadAttention`` ``attn_mask`` (bool: True = *masked*; float: added to the
    scores) is exactly the (square) causal mask, 2-D (L, S) or 3-D (batch*heads, L, S)."""
    if n_q != n_k or mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != (n_q, n_k):
        return False
    allowed = causal_bool(n_q, n_k, mask.device)
    if mask.dtype == torch.bool:
        return bool((mask == ~allowed).all())
    if not mask.is_floating_point():
        return False
    masked = torch.full_like(allowed, float("-inf"), dtype=mask.dtype)
    expected = torch.where(allowed, torch.zeros_like(masked), masked)
    return bool((mask == expected).all())


def right_padding_lengths(key_padding_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Key lengths L (int64, (N,)) if a ``key_padding_mask`` (N, S) is right padding — row b keeps keys
    j < L[b] and masks the rest, L[b] >= 1 — else None. Boolean masks: True = ignore; float masks (added to
    the scores, as ``nn.TransformerEncoderLayer`` hands a boolean one over after converting it): 0 = keep,
    -inf = ignore, any other value makes it not padding. Reads the values."""
    if key_padding_mask.dim() != 2:
        return None
    if key_padding_mask.is_floating_point():
        masked = key_padding_mask == float("-inf")
        if not bool((masked | (key_padding_mask == 0)).all()):
            return None
        key_padding_mask = masked
    elif key_padding_mask.dtype != torch.bool:
        return None
    lengths = (~key_padding_mask).sum(dim=-1)
    expected = torch.arange(key_padding_mask.shape[-1], device=key_padding_mask.device)[None, :] >= lengths[:, None]
    if not bool((lengths >= 1).all()) or not bool((key_padding_mask == expected).all()):
        return None
    return lengths


def _masks_keys(key_padding_mask: torch.Tensor) -> bool:
    """True unless the ``key_padding_mask`` masks nothing (bool: no True; float: all zeros), in
    which case the call equals the call without it."""
    if key_padding_mask.dtype == torch.bool:
        return bool(key_padding_mask.any())
    return not (key_padding_mask.is_floating_point() and bool((key_padding_mask == 0).all()))


class GProjMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose attention runs :func:`lightning_gproj.ops.gproj_attn_func`.

    Never constructed directly: :func:`swap_module` sets an existing module's ``__class__``. Shapes
    as in ``nn.MultiheadAttention``: query (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
    unbatched; key/value likewise with S for L. Returns ``(output, None)``.

    Served: ``need_weights=False``, no ``key_padding_mask``, one that masks nothing, or one that is right
    padding, boolean or float of 0 and -inf (as ``nn.TransformerEncoderLayer`` passes a boolean mask on)
    (each batch row masks a suffix of the keys and keeps at least one; served
    with ``seqlens_k``, alone or with the causal mask), ``attn_mask`` None or the causal mask
    (``is_causal=True`` with a mask and no ``key_padding_mask``, trusted as the original does on this path; or a
    mask whose values are exactly causal — with a ``key_padding_mask``, or in eval mode without gradients, where the
    original's fast path may run, the original follows the mask and so does the swap), ``dropout`` (applied while training, as the original does, by the op's
    own Philox mask), causal only with L == S,
    head dim (embed_dim / num_heads) a multiple of 8 up to the op's ``MAX_HEAD_DIM``.
    Any other call runs ``nn.MultiheadAttention.forward`` unchanged (one
    :class:`GProjFallbackWarning` per module). Note ``need_weights`` defaults to True: such calls
    keep the original path.
    """

    _gproj_site: Site

    def _may_take_fast_path(self, query, key, value) -> bool:
        """Whether ``nn.MultiheadAttention.forward`` might run its inference fast path on this call: not training,
        and no gradient wanted (grad mode off, or no input or projection parameter requiring it). Its other conditions
        (self-attention, batch_first, boolean masks, …) are not checked: True where the fast path is possible, not
        certain."""
        if self.training:
            return False
        args = (query, key, value, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias)
        return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args))

    def _plan(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """``(reason, causal, seqlens_k)``: reason None when the op serves the call."""
        if need_weights:
            return "need_weights=True (the weights need the full attention matrix; pass need_weights=False)", False, None
        seqlens_k = None
        if key_padding_mask is not None and _masks_keys(key_padding_mask):
            kpm = key_padding_mask.unsqueeze(0) if key_padding_mask.dim() == 1 else key_padding_mask
            seqlens_k = right_padding_lengths(kpm)
            if seqlens_k is None:
                return (
                    "key_padding_mask that is not right padding (boolean, or float of 0 and -inf; each row must "
                    "mask a suffix of the keys and keep at least one)"
                ), False, None
        if query.dim() not in (2, 3) or query.dim() != key.dim() or key.dim() != value.dim():
            return f"input dims query {query.dim()}, key {key.dim()}, value {value.dim()}", False, None
        if not (query.dtype == key.dtype == value.dtype):
            return "query/key/value differ in dtype", False, None
        reason = op_reason(self.head_dim, query.numel(), key.numel())
        if reason is not None:
            return reason, False, None
        seq = 1 if (self.batch_first and query.dim() == 3) else 0
        n_q, n_k = query.shape[seq], key.shape[seq]
        if seqlens_k is not None:
            batch = 1 if query.dim() == 2 else query.shape[1 - seq]
            if seqlens_k.shape[0] != batch or key_padding_mask.shape[-1] != n_k:
                return f"key_padding_mask of shape {tuple(key_padding_mask.shape)}", False, None
            if seqlens_k.device != query.device:
                return "key_padding_mask on another device", False, None
        if attn_mask is None:
            if is_causal:
                return "is_causal without attn_mask", False, None  # the original raises; let it
            return None, False, seqlens_k
        if n_q != n_k:
            return f"attn_mask with L={n_q} != S={n_k} (causal alignment differs)", False, None
        # The original trusts the is_causal hint only without a key_padding_mask (with one it merges the padding
        # into attn_mask and follows the mask: torch.nn.functional.multi_head_attention_forward), and not on its
        # inference fast path (torch._native_multi_head_attention applies attn_mask): there the mask's values decide.
        trust_hint = is_causal and key_padding_mask is None and not self._may_take_fast_path(query, key, value)
        if trust_hint or _is_causal_mha_mask(attn_mask, n_q, n_k):
            return None, True, seqlens_k
        return "attn_mask is not the causal mask", False, None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        site = self._gproj_site
        reason, causal, seqlens_k = self._plan(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason is not None:
            site.fallback(reason)
            with Guard():  # an enclosing catch-all must not serve the original's inner SDPA call
                return nn.MultiheadAttention.forward(
                    self, query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                    attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal,
                )
        site.served += 1
        self_attention = query is key and key is value
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if not self.batch_first or unbatched:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        e, h = self.embed_dim, self.num_heads
        w, bias = self.in_proj_weight, self.in_proj_bias
        if self_attention:
            q, k, v = F.linear(query, w, bias).chunk(3, dim=-1)
        else:
            b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
            w_q, w_k, w_v = w.chunk(3)
            q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        n, n_q = q.shape[0], q.shape[1]
        o = site.attention(
            q.unflatten(-1, (h, e // h)), k.unflatten(-1, (h, e // h)), v.unflatten(-1, (h, e // h)), causal=causal,
            seqlens_k=seqlens_k, dropout_p=self.dropout if self.training else 0.0,
        )
        out = F.linear(o.reshape(n, n_q, e), self.out_proj.weight, self.out_proj.bias)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        return out, None


def swap_module(module: nn.MultiheadAttention, name: str, fix: str, site: Optional[Site] = None) -> Site:
    """Turn ``module`` into a :class:`GProjMultiheadAttention` in place (idempotent: a second call
    only updates ``fix``); ``site`` reuses an earlier :class:`Site`. Call :func:`static_reason`
    first: it must be None."""
    if isinstance(module, GProjMultiheadAttention):
        module._gproj_site.fix = fix
        return module._gproj_site
    site = site or Site(name, "nn.MultiheadAttention", fix)
    site.fix, site.keep = fix, False
    module._gproj_site = site
    module.__class__ = GProjMultiheadAttention
    return module._gproj_site


def unswap_module(module: nn.Module) -> bool:
    """Turn a :class:`GProjMultiheadAttention` back into ``nn.MultiheadAttention``."""
    if not isinstance(module, GProjMultiheadAttention):
        return False
    module.__class__ = nn.MultiheadAttention
    del module._gproj_site
    return True
