"""Route Hugging Face ``transformers`` attention to ``gproj_attn_func`` through its registries.

Models written on ``transformers``' attention interface (Llama, Qwen2, GPT-NeoX, ViT, ...) look their
attention function up by ``config._attn_implementation`` in ``AttentionInterface`` on every call, and
their mask builder in ``AttentionMaskInterface``. :func:`register` adds ``"gproj"`` to both: the
attention function :func:`gproj_attention_forward` and, as mask builder, ``transformers``' own SDPA
mask builder (``sdpa_mask``), which returns None for a purely causal (or full) mask and a boolean
(batch, 1, Nq, Nk) mask otherwise. :func:`swap_model` sets ``"gproj"`` with
``model.set_attn_implementation`` (config attribute on versions without it) and gives every attention
module a :class:`Site` (``module._gproj_site``); unselected modules get none and run, silently, what the model ran
before (its eager attention for ``"eager"``, else ``sdpa_attention_forward``; the eager one wherever the call's
attention weights are asked for: :func:`_original_forward`). ``transformers`` (>= 4.53, for ``AttentionMaskInterface``) is optional: nothing here imports it
unless the model is a ``transformers`` model (it is imported then).

Served, as ``sdpa_attention_forward`` would compute it: mask None (causal from ``is_causal`` /
``module.is_causal``, with its crop of keys to Nq for a causal Nq < Nk prefill), boolean masks
that are all True, exactly the bottom-right causal mask, right key padding, or (Nq == Nk) causal &
right key padding — what ``sdpa_mask`` builds from a right-padded ``attention_mask`` — checked value
by value and served with ``seqlens_k``; (Nq == Nk) causal & left key padding, served as packed sequences
through ``gproj_attn_varlen_func`` (flash-attention's unpadding: the valid tokens gathered, the output
scattered back with zeros at the padding tokens, whose rows see no key; SDPA gives them zeros too);
``scaling``, GQA
(``num_key_value_groups``: k/v keep their heads), the ``dropout`` the model passes (its
``attention_dropout`` / ``attn_pdrop`` while training, 0 in eval: served as the op's ``dropout_p``, the
op's own Philox mask); sliding-window layers (the
``sliding_window=W`` keyword Mistral, Qwen2 and Gemma 2 pass: key j visible to query i iff
j > i − W, with the causal mask, i.e. the op's ``window_size=(W − 1, 0)``; the boolean mask
``sdpa_mask`` builds for it is checked value by value against that band, or (Nq == Nk) against the band
& right key padding, served with ``seqlens_k``, or & left key padding, served unpadded), and Gemma 2's
logit ``softcap``. Falls back to ``sdpa_attention_forward`` — or the model's own ``eager_attention_forward``, given
the additive mask eager expects, where the model ran ``"eager"`` before the swap, or the call carries a softcap,
which SDPA refuses, or attention sinks, which it ignores (also in layers left unswapped, which run the same) — with one :class:`GProjFallbackWarning` per module for other mask patterns (holes in the
padding, left padding of a non-causal or cached call), float masks, ``position_bias``,
attention sinks (``s_aux``), and head dims the op does not take (on every path: plain, padded, windowed,
packed). A call whose attention weights are asked for (``output_attentions=True``) runs the model's eager
attention, which returns them — with the warning in a swapped layer, silently in a layer left unswapped. Packed sequences (batch 1, several
sequences flattened into one row, as ``DataCollatorWithFlattening`` builds them) are served through
``gproj_attn_varlen_func``, as transformers' flash-attention integration computes them (not as
``sdpa_attention_forward``, which lets packed sequences see each other when no mask was built): from
the ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments when all four are given, else from
``position_ids`` that are not one increasing run (a new sequence at each position equal to their
minimum, the rule of ``prepare_fa_kwargs_from_position_ids``); with ``sliding_window`` and ``softcap``
too, the window within each sequence. The mask that arrives must then be None (as with a cache),
exactly the block-diagonal mask of those sequences (causal within each, or full; with a window the
causal band within each), or the causal (band) mask over the whole row that transformers builds for
packed inputs when a cache is in use (``use_cache`` defaults to True, in training too), checked value by
value; every layer then treats the row as the same packed sequences.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Optional

import torch
from torch import nn

from lightning_gproj import ops

from . import sdpa
from ._common import Guard, Site, dropout_reason, op_reason

#: The name registered in ``AttentionInterface`` and ``AttentionMaskInterface``.
NAME = "gproj"
#: Keyword arguments that change the attention's result and that the op does not serve.
_REFUSED = ("position_bias", "s_aux", "sinks")


def is_pretrained(module: nn.Module) -> bool:
    """True if ``module`` is a ``transformers.PreTrainedModel`` (False when transformers was never imported)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return modeling_utils is not None and isinstance(module, modeling_utils.PreTrainedModel)


def is_attention_module(module: nn.Module) -> bool:
    """True if a function of ``module``'s class looks attention up in ``ALL_ATTENTION_FUNCTIONS``."""
    if not hasattr(module, "config") or is_pretrained(module):  # models name it in PreTrainedModel methods
        return False
    for cls in type(module).__mro__:
        if cls is nn.Module or cls is object:
            continue
        for value in vars(cls).values():
            for fn in sdpa._functions_of(value):
                if "ALL_ATTENTION_FUNCTIONS" in sdpa._code_names(fn.__code__):
                    return True
    return False


def register() -> None:
    """Register ``"gproj"`` in ``transformers``' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gproj_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


#: Keyword arguments only the model's own eager attention applies (SDPA raises on softcap and ignores
#: attention sinks): calls that carry one and are not served fall back to eager.
_EAGER_ONLY = ("softcap", "s_aux", "sinks", "position_bias")


def _weights_requested(kwargs: dict) -> bool:
    """Whether the caller asked for the attention weights: ``output_attentions`` handed to the attention function (as
    some models do), or transformers' output collector (``capture_outputs``, transformers 5) collecting attention
    weights now. The op computes none, so such calls run the model's eager attention."""
    if kwargs.get("output_attentions"):
        return True
    collector = getattr(sys.modules.get("transformers.utils.output_capturing"), "_active_collector", None)
    if collector is None:
        return False
    if torch.compiler.is_compiling():  # its ContextVar is not traced; under compile it keeps a plain attribute
        collected = collector.global_var if getattr(collector, "compiling", False) else None
    else:
        collected = collector.get()
    return isinstance(collected, dict) and any(key.endswith("attentions") for key in collected)


def _original_forward(module, kwargs: dict, weights: bool = False):
    """The attention function of a call GProj does not serve (a fallback, or a module left unswapped): the model's own
    eager attention (:func:`_eager_forward`) where the call carries something only eager applies (:data:`_EAGER_ONLY`),
    or, if the module defines one, where the model ran ``"eager"`` before the swap (``module._gproj_hf_impl``, set by
    the swap) or the call's weights were asked for; else ``sdpa_attention_forward``."""
    if any(kwargs.get(name) is not None for name in _EAGER_ONLY):
        return _eager_forward
    if ((weights or module.__dict__.get("_gproj_hf_impl") == "eager")
            and hasattr(sys.modules.get(type(module).__module__), "eager_attention_forward")):
        return _eager_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _eager_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The model's own eager attention (its module's ``eager_attention_forward``, which applies softcap and
    sinks), given the additive float mask eager expects. The masks of implementation ``"gproj"`` are
    ``sdpa_mask``'s: boolean (True = attend), or None for plain causal (Nq == Nk, or one query) or full
    attention — eager would add a boolean mask to the scores as 0 / 1 and apply no mask for None, so both
    become what transformers' ``eager_mask`` builds: 0 where attended, the dtype's minimum elsewhere."""
    n_q, n_k = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and n_q > 1
        if causal:
            i = torch.arange(n_q, device=query.device)[:, None] + (n_k - n_q)
            attention_mask = (torch.arange(n_k, device=query.device)[None, :] <= i)[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward")
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _packed_cu_seqlens(query, key, kwargs) -> Optional[tuple]:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` when the call carries packed
    sequences (batch 1): the ``cu_seq_lens_*`` / ``max_length_*`` keyword arguments, or ``position_ids``
    that are not one increasing run (a sequence starts at each position equal to their minimum); else
    None."""
    if query.shape[0] != 1:
        return None
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        return tuple(given)
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() != query.shape[2] or key.shape[2] != query.shape[2]:
        return None
    pos = position_ids.reshape(-1)
    n = pos.numel()
    if n == 1 or torch.equal(pos, torch.arange(n, device=pos.device) + pos.min()):
        return None
    starts = (pos == pos.min()).nonzero().view(-1)
    cu = torch.cat([starts, starts.new_full((1,), n)]).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def _block_diagonal(cu_seqlens_q, cu_seqlens_k, causal: bool, device, window: Optional[int] = None) -> torch.Tensor:
    """(total_q, total_k) boolean: packed query i sees key j iff both are in sequence b and (causal) the
    bottom-right rule holds within it (with ``window`` W, causal: also j > i − W in local positions)."""
    lens_q, lens_k = cu_seqlens_q.diff().long().to(device), cu_seqlens_k.diff().long().to(device)
    seq_q = torch.repeat_interleave(torch.arange(lens_q.numel(), device=device), lens_q)
    seq_k = torch.repeat_interleave(torch.arange(lens_k.numel(), device=device), lens_k)
    same = seq_q[:, None] == seq_k[None, :]
    if not causal:
        return same
    local_q = torch.arange(seq_q.numel(), device=device) - cu_seqlens_q.long().to(device)[seq_q]
    local_k = torch.arange(seq_k.numel(), device=device) - cu_seqlens_k.long().to(device)[seq_k]
    diag = (local_q + lens_k[seq_q] - lens_q[seq_q])[:, None]
    seen = same & (local_k[None, :] <= diag)
    return seen if window is None else seen & (local_k[None, :] > diag - window)


def _plan_packed(module, query, key, value, attention_mask, scaling, is_causal, packed, window, softcap):
    """``(reason, call)`` for a packed call: ``call`` = (q, k, v, scale, causal, None, window_size, softcap,
    packed) with q (total_q, heads, dim), k, v (total_k, kv_heads, dim); ``window``: None or the
    ``sliding_window`` W (causal only, the op's ``window_size=(W − 1, 0)`` within each sequence)."""
    cu_q, cu_k, max_q, max_k = packed
    if not all(isinstance(t, torch.Tensor) for t in (cu_q, cu_k)):
        return "cu_seq_lens_q/cu_seq_lens_k that are not tensors", None
    if (cu_q.numel() < 2 or cu_k.numel() < 2 or int(cu_q[0]) != 0 or int(cu_k[0]) != 0
            or int(cu_q[-1]) != query.shape[2] or int(cu_k[-1]) != key.shape[2]):
        return "packed sequences whose cu_seq_lens (or position_ids) do not cover the tokens from 0", None
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
            return "packed sequences with an attention_mask that is not boolean 4-D", None
        seen = attention_mask[0]
        causal = None
        for candidate in (True, False) if window is None else (True,):
            if bool((seen == _block_diagonal(cu_q, cu_k, candidate, seen.device, window)).all()):
                causal = candidate
                break
        # With a cache, transformers builds one causal band over the whole row for packed inputs (the
        # sequences would see each other) and passes no mask to layers without a window. Reading that
        # band as packed too keeps every layer of the model on one meaning, flash-attention's.
        whole_row = torch.tensor([0, query.shape[2]]), torch.tensor([0, key.shape[2]])
        if causal is None and bool((seen == _block_diagonal(*whole_row, True, seen.device, window)).all()):
            causal = True
        if causal is None:
            return "packed sequences with an attention_mask that is not their block-diagonal mask", None
    if window is not None and not causal:
        return "sliding_window without a causal mask", None
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return None, (q, k, v, scaling, causal, None, (-1, -1) if window is None else (window - 1, 0), softcap, packed,
                  None)


def _padded_keys(mask: torch.Tensor, allowed: torch.Tensor) -> Optional[torch.Tensor]:
    """The (batch, N) valid keys V if the boolean (batch, heads or 1, N, N) mask equals ``allowed & V[b, j]``
    — the causal mask or band ``allowed`` (N, N) with key padding, as ``sdpa_mask`` builds it from a
    padded ``attention_mask`` — with a valid key in every batch row; else None. ``allowed`` holds the
    diagonal, so each valid key is seen by its own row. Right padding (V a prefix) is served with
    ``seqlens_k``; left padding (a suffix) as packed sequences, since its padding rows see no key (SDPA
    gives them zeros). Reads the mask's values (a device sync)."""
    if mask.dim() != 4 or mask.shape[-2] != mask.shape[-1]:
        return None
    valid = mask[:, 0].any(dim=-2)
    if not bool(valid.any(dim=-1).all()):
        return None
    return valid if bool((mask == (allowed[None, None] & valid[:, None, None, :])).all()) else None


def _is_suffix(valid: torch.Tensor) -> bool:
    """Every row of the (batch, N) valid keys is False* True+ (left padding)."""
    return bool((valid[:, 1:] >= valid[:, :-1]).all())


def _plan_unpadded(query, key, value, valid: torch.Tensor, scaling, window: Optional[int], softcap: float):
    """A left-padded batch as packed sequences (flash-attention's unpadding): the valid tokens of each
    row gathered into (total, heads, dim), served causal by the varlen op, scattered back with zeros
    at the padding tokens (:func:`gproj_attention_forward`)."""
    b, n = valid.shape
    counts = valid.sum(dim=-1)
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    idx = valid.flatten().nonzero().squeeze(1)
    q, k, v = (x.transpose(1, 2).reshape(b * n, x.shape[1], x.shape[3])[idx] for x in (query, key, value))
    longest = int(counts.max())
    return None, (q, k, v, scaling, True, None, (-1, -1) if window is None else (window - 1, 0), softcap,
                  (cu, cu, longest, longest), (idx, b, n))


def plan(module: nn.Module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """``(reason, (q, k, v, scale, causal, seqlens_k, window_size, softcap, packed, unpad))`` in the op layout; reason None when the
    op serves the call as ``sdpa_attention_forward`` would compute it. query, key, value: (batch,
    heads, seqlen, dim). A boolean 4-D mask is served when its values equal what the op applies: all
    True, the causal mask, right key padding, or (Nq == Nk) causal & right key padding — the mask
    ``sdpa_mask`` builds for a right-padded ``attention_mask`` — with ``seqlens_k`` the per-row count
    of valid keys (:func:`lightning_gproj.swap.sdpa.plan` checks the values). ``packed``: None, or
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed sequences (module docstring),
    q then (total_q, heads, dim) and k, v (total_k, kv_heads, dim). ``unpad``: None, or (indices, batch,
    N) for a left-padded batch served as packed sequences (:func:`_plan_unpadded`)."""
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            return f"{name} is set", None
    try:  # as the op takes it (NumPy numbers, a 1-element tensor); inf, NaN, a bool fall back
        softcap = ops._check_softcap(kwargs.get("softcap") or 0.0)
    except ValueError:
        return f"softcap={kwargs.get('softcap')!r}", None
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
            return f"sliding_window={window!r}", None
        window = int(window)
    reason = dropout_reason(dropout)
    if reason is not None:
        return reason, None
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)) or query.dim() != 4:
        return "query/key/value are not 4-D tensors", None
    if value.shape[-1] != query.shape[-1]:
        return f"value headdim {value.shape[-1]} differs from query headdim {query.shape[-1]}", None
    reason = op_reason(query.shape[-1], query.numel(), key.numel(), scaling)  # every path below serves through the op
    if reason is not None:
        return reason, None
    packed = _packed_cu_seqlens(query, key, kwargs)
    if packed is not None:
        reason, call = _plan_packed(module, query, key, value, attention_mask, scaling, is_causal, packed, window,
                                    float(softcap))
        explicit = kwargs.get("cu_seq_lens_q") is not None
        if reason is None or explicit or attention_mask is None:
            return reason, call
        # position_ids that look packed (generate gives a left-padded prompt [0, 0, 0, 0, 1, 2, ...]) with a
        # mask that is not those sequences' mask: the mask decides, as in transformers' flash-attention path
    n_q = query.shape[2]
    causal = False
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and n_q > 1
        if causal and key.dim() == 4 and key.shape[2] > n_q:
            # as sdpa_attention_forward: an empty-cache prefill keeps the first Nq keys, top-left causal
            key, value = key[:, :, :n_q], value[:, :, :n_q]
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        return f"attention_mask of dtype {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} (only boolean causal / right-padding masks are served)", None
    if window is not None and attention_mask is None and n_q == 1:
        window = None  # one query and no mask (a 1-token prompt, a decode step inside the window): SDPA sees every key
    if window is not None:
        # causal with keys j > i − W (bottom-right aligned as sdpa_mask builds it for Nq <= Nk)
        n_k = key.shape[2]
        seqlens_k = None
        if attention_mask is not None:
            i = torch.arange(n_q, device=query.device)[:, None] + (n_k - n_q)
            j = torch.arange(n_k, device=query.device)[None, :]
            band = (j <= i) & (j > i - window)
            if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (n_q, n_k):
                return "a sliding-window mask of another shape than (batch, 1, Nq, Nk)", None
            if not bool((attention_mask == band).all()):
                valid = _padded_keys(attention_mask, band)
                if valid is None:
                    return ("a sliding-window mask with another pattern than the causal band & right or left key "
                            "padding"), None
                if _is_suffix(valid):
                    return _plan_unpadded(query, key, value, valid, scaling, window, float(softcap))
                if not bool((valid[:, 1:] <= valid[:, :-1]).all()):  # neither left nor right padding
                    return "a sliding-window mask with key padding on both sides or holes", None
                seqlens_k = valid.sum(dim=-1)
            causal = True
        elif not causal:
            return "sliding_window without a causal mask", None
        return None, (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling, True, seqlens_k,
                      (window - 1, 0), float(softcap), None, None)
    reason, causal_mask, seqlens_k = sdpa.plan(
        (query, key, value),
        dict(attn_mask=attention_mask, dropout_p=0.0, is_causal=causal, scale=scaling, enable_gqa=True),
    )
    if reason is not None:
        if attention_mask is not None and ("not the causal mask" in reason or "not right padding" in reason):
            tril = torch.ones(n_q, n_q, dtype=torch.bool, device=query.device).tril()
            valid = _padded_keys(attention_mask, tril) if key.shape[2] == n_q else None
            if valid is not None and _is_suffix(valid):
                return _plan_unpadded(query, key, value, valid, scaling, None, float(softcap))
            reason = ("an attention_mask with another pattern than causal & right padding, or causal & left padding "
                      "without a cache (Nq == Nk; a cached call with left padding, as generate's decode steps, "
                      "falls back)" if key.shape[2] != n_q else
                      "an attention_mask with another pattern than causal & right or left padding")
        return reason, None
    return None, (
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling, causal or causal_mask, seqlens_k,
        (-1, -1), float(softcap), None, None,
    )


def gproj_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function ``"gproj"``: query (batch, heads, Nq, dim), key/value
    (batch, kv_heads, Nk, dim) -> ``(attn_output (batch, Nq, heads, dim), None)``."""
    site: Optional[Site] = getattr(module, "_gproj_site", None)
    weights = _weights_requested(kwargs)
    if site is None or site.keep or Guard.depth > 0:
        return _original_forward(module, kwargs, weights)(module, query, key, value, attention_mask, dropout=dropout,
                                                          scaling=scaling, is_causal=is_causal, **kwargs)
    if weights:
        reason, call = "output_attentions=True (the op computes no attention weights)", None
    else:
        reason, call = plan(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if reason is not None:
        site.fallback(reason)
        with Guard():
            return _original_forward(module, kwargs, weights)(module, query, key, value, attention_mask,
                                                              dropout=dropout, scaling=scaling, is_causal=is_causal,
                                                              **kwargs)
    site.served += 1
    q, k, v, scale, causal, seqlens_k, window, softcap, packed, unpad = call
    with Guard():  # an enclosing SDPAMode must not take the SDPA call of an fp32 remediation
        if packed is not None:
            out = site.attention_varlen(q, k, v, *packed, softmax_scale=scale, causal=causal, window_size=window,
                                        softcap=softcap, dropout_p=float(dropout))
            if unpad is None:
                return out[None], None
            idx, b, n = unpad  # left padding: the packed rows back in place, zeros at the padding tokens
            return out.new_zeros((b * n,) + out.shape[1:]).index_copy(0, idx, out).view(b, n, *out.shape[1:]), None
        return site.attention(q, k, v, softmax_scale=scale, causal=causal, seqlens_k=seqlens_k, window_size=window,
                              softcap=softcap, dropout_p=float(dropout)), None


def _set_implementation(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # versions without the method: the config attribute (shared by the submodels)
        model.config._attn_implementation = name


def swap_model(model: nn.Module) -> Optional[str]:
    """Register ``"gproj"`` and set it as ``model``'s attention implementation; returns None, or why
    not (the original implementation stays). The original name is kept in
    ``model._gproj_hf_original`` for :func:`unswap_model`."""
    register()
    current = getattr(model.config, "_attn_implementation", None)
    original = model.__dict__.get("_gproj_hf_original", current)
    if current != NAME:
        try:
            _set_implementation(model, NAME)
        except Exception as err:  # the model refuses dynamic switching
            return f"set_attn_implementation('gproj') failed ({err.__class__.__name__}: {err})"
        if getattr(model.config, "_attn_implementation", None) != NAME:
            return f"{type(model).__name__} does not let its attention implementation be set (it stays {current!r})"
    model._gproj_hf_original = original
    return None


def swap_module(module: nn.Module, name: str, fix: str, site: Optional[Site] = None) -> Site:
    """Give an attention module its :class:`Site` (``module._gproj_site``; idempotent)."""
    site = module.__dict__.get("_gproj_site") or site or Site(name, type(module).__name__, fix)
    site.fix, site.keep = fix, False
    module._gproj_site = site
    return site


def unswap_module(module: nn.Module) -> bool:
    """Undo :func:`swap_module` or :func:`swap_model` on one module; returns whether it was swapped."""
    count = False
    module.__dict__.pop("_gproj_hf_impl", None)
    if "_gproj_site" in module.__dict__ and is_attention_module(module):
        del module._gproj_site
        count = True
    if "_gproj_hf_original" in module.__dict__:
        original = module.__dict__.pop("_gproj_hf_original")
        if getattr(module.config, "_attn_implementation", None) == NAME and original not in (None, NAME):
            _set_implementation(module, original)
    return count
