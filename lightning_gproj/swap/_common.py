"""Pieces shared by the swap targets: the op handle, module selection, fallback warnings.

Nothing here knows about Lightning; :mod:`lightning_gproj.plugin` drives it.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Iterable, NamedTuple, Optional, Sequence

import torch

from lightning_gproj import ops
from lightning_gproj.kernels.reference import FIXES
from lightning_gproj.stats import RECORDER


class GProjFallbackWarning(UserWarning):
    """A swapped attention module met a call it cannot serve exactly and ran the original code.

    Raised at most once per module (the first fallback); the result of that call is the original's.
    """


class GProjFallbackError(RuntimeError):
    """A swapped attention module met a call it cannot serve exactly, and its swap was made with
    ``strict=True`` (``GProjPlugin(strict=True)``, ``swap_attention(..., strict=True)``): raised
    instead of running the original code, so that no step silently trains without GProj."""


class SwapRow(NamedTuple):
    """One line of a :class:`SwapReport`: ``replacement`` is None when the module was left alone."""

    module_path: str
    original: str
    replacement: Optional[str]
    reason: str


def check_ds_format(ds_format: object) -> str:
    """Return ``ds_format`` if the op accepts it, else raise ValueError naming the accepted values."""
    if not isinstance(ds_format, str) or ds_format not in ops.DS_FORMATS:
        raise ValueError(f"`ds_format` must be one of {ops.DS_FORMATS}, got {ds_format!r}")
    return ds_format


def check_fix(fix: object) -> str:
    """Return ``fix`` if it is one of :data:`FIXES`, else raise ValueError naming the accepted values."""
    if not isinstance(fix, str) or fix not in FIXES:
        raise ValueError(f"`fix` must be one of {FIXES}, got {fix!r}")
    return fix


def check_patterns(name: str, patterns: object) -> Optional[tuple[str, ...]]:
    """Normalize ``include``/``exclude``: None, one glob string, or a sequence of glob strings.

    Raises:
        TypeError: for anything else (naming the argument ``name``).
        ValueError: an empty pattern: it matches the root module's path "" and so, as a subtree, the whole model
            (``include=""`` selected every module, ``exclude=""`` left every module alone); None selects everything.
    """
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = (patterns,)
    if isinstance(patterns, Iterable) and not isinstance(patterns, (bytes, dict)):
        patterns = tuple(patterns)
        if all(isinstance(p, str) for p in patterns):
            if "" in patterns:
                none = "select every module" if name == "include" else "exclude nothing"
                raise ValueError(
                    f"`{name}` has an empty pattern: it would match the root module and with it the whole model; "
                    f"pass None to {none}, or a glob over module paths (e.g. 'blocks.*.attn'), got {list(patterns)!r}"
                )
            return patterns
    raise TypeError(
        f"`{name}` must be None, a glob string or a sequence of glob strings over module paths "
        f"(e.g. 'blocks.*.attn'), got {patterns!r}"
    )


def display_path(path: str) -> str:
    """Module path as shown to users: the root module has the empty path and is shown as ``<root>``."""
    return path or "<root>"


def _self_and_ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def _match(path: str, patterns: Sequence[str]) -> Optional[str]:
    """The first pattern matching ``path`` or one of its ancestors (a pattern selects a subtree)."""
    for prefix in _self_and_ancestors(path):
        for pattern in patterns:
            if fnmatch.fnmatchcase(prefix, pattern):
                return pattern
    return None


def selection_reason(
    path: str, include: Optional[Sequence[str]], exclude: Optional[Sequence[str]]
) -> Optional[str]:
    """None if the module at ``path`` is selected for swapping, else why not.

    A pattern matches a module when it matches the module's path or the path of one of its
    ancestors (``fnmatch`` rules, so ``*`` also matches dots), so ``exclude="decoder"`` leaves the
    whole decoder alone.
    """
    if include is not None and _match(path, include) is None:
        return f"not matched by include={list(include)}"
    if exclude is not None:
        pattern = _match(path, exclude)
        if pattern is not None:
            return f"excluded by pattern {pattern!r}"
    return None


def shared_selection_reason(
    paths: Sequence[str], include: Optional[Sequence[str]], exclude: Optional[Sequence[str]]
) -> Optional[str]:
    """:func:`selection_reason` of one module reachable at several ``paths`` (held under two names, tied
    layers), which is swapped at all of them or at none: selected when one path is included and none is
    excluded. One path: the same as :func:`selection_reason`."""
    reasons = [selection_reason(path, include, None) for path in paths]
    if None not in reasons:
        return reasons[0]
    for path in paths:
        reason = selection_reason(path, None, exclude)
        if reason is not None:
            return reason if path == paths[0] else f"{reason} (at {display_path(path)})"
    return None


class Guard:
    """Re-entrancy depth: while positive, GProj modes let SDPA through untouched. Raised while a mode
    serves a call (the op's internals, the fallback call itself) and while a swapped module runs its
    original code, so an enclosing catch-all never reinterprets what a module chose to keep."""

    depth = 0

    def __enter__(self) -> "Guard":
        Guard.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        Guard.depth -= 1




def dropout_reason(dropout_p: object) -> Optional[str]:
    """None if the op takes this attention-dropout probability (its own check, ``ops._check_dropout``:
    a number in [0, 1)), else why not. Silent: the op's own call warns where it rounds p (once, not twice)."""
    try:
        ops._check_dropout(dropout_p, warn=False)
    except ValueError:
        return f"dropout_p={dropout_p!r} (the op takes a probability in [0, 1))"
    return None


def op_reason(head_dim: int, numel_q: int, numel_k: int, scale: object = None) -> Optional[str]:
    """None if the op takes this head dim, non-empty inputs and ``scale``, else why not (the op's own
    limits: headdim a multiple of 8 in [8, MAX_HEAD_DIM], ``scale`` as ``ops._check_softmax_scale`` takes it)."""
    max_head_dim = getattr(ops, "MAX_HEAD_DIM", 256)
    if head_dim % 8 != 0 or not 8 <= head_dim <= max_head_dim:
        return f"headdim {head_dim} (the op takes multiples of 8 in [8, {max_head_dim}])"
    if numel_q == 0 or numel_k == 0:
        return "empty inputs"
    if scale is not None:
        try:
            ops._check_softmax_scale(scale, head_dim)  # the op's own check: NumPy numbers and 1-element tensors pass
        except ValueError:
            return f"scale={scale!r} (the op takes a positive float ≤ {ops._MAX_SOFTMAX_SCALE_TEXT})"
    return None


def gproj_attn_func():
    """The op :func:`lightning_gproj.ops.gproj_attn_func`, looked up at call time (so tests may
    monkeypatch it)."""
    return ops.gproj_attn_func


def gproj_attn_varlen_func():
    """The op :func:`lightning_gproj.ops.gproj_attn_varlen_func`, looked up at call time."""
    return ops.gproj_attn_varlen_func


class Site:
    """State of one swapped module: its name (also the op's ``stats_name``), ``fix`` and fallbacks.

    ``keep=True`` marks a module left alone inside a catch-all region: its SDPA calls run the
    original.
    ``fallbacks`` counts the calls that ran the original code, by reason; ``served`` counts the
    calls that ran :func:`gproj_attn_func`.
    ``compute_dtype`` (default None): ``torch.float32`` (the monitors' "fp32" remediation): served
    calls run SDPA in fp32 instead of the op; ``torch.bfloat16`` / ``torch.float16``: served calls run
    the op on q, k, v cast to that dtype; either way the output is cast back to q's dtype.
    ``strict``: a fallback raises :class:`GProjFallbackError` instead of running the original.
    ``ds_format`` (default ``"bf16"``): passed to the op (how its backward rounds dS).
    """

    def __init__(self, name: str, kind: str, fix: str, keep: bool = False) -> None:
        self.name = name
        self.kind = kind
        self.fix = fix
        self.keep = keep
        #: True for a catch-all region's site (``swap_attention(catch_all=True)``): it serves only the calls no swapped
        #: module inside the region serves, so seeing none is normal.
        self.catch_all = False
        self.strict = False
        self.compute_dtype: Optional[torch.dtype] = None
        self.ds_format = "bf16"
        self.served = 0
        self.fallbacks: dict[str, int] = {}
        self.warned = False

    @property
    def sdpa_arm(self) -> bool:
        """``compute_dtype`` fp32 or fp64: served calls run SDPA in that dtype, ``fix`` and ``ds_format`` unused."""
        return self.compute_dtype in (torch.float32, torch.float64)

    @property
    def fallback_count(self) -> int:
        """Calls that ran the original code, all reasons together."""
        return sum(self.fallbacks.values())

    def fallback(self, reason: str) -> None:
        """Record a fallback; warn (:class:`GProjFallbackWarning`) the first time for this module.

        Raises:
            GProjFallbackError: with ``strict`` set, instead of letting the original run.
        """
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        where = f"GProj: {display_path(self.name)} ({self.kind})"
        if self.strict:
            raise GProjFallbackError(
                f"{where} cannot serve this call exactly: {reason}. strict=True refuses to run the original "
                f"attention; change the call (or the model's configuration) or swap without strict=True."
            )
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"{where} runs its original attention for this call: {reason}. The result is the "
                f"original's; further fallbacks of this module are counted, not reported "
                f"(strict=True raises instead).",
                GProjFallbackWarning,
                stacklevel=4,
            )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        softmax_scale=None,
        causal: bool = False,
        seqlens_k: Optional[torch.Tensor] = None,
        window_size: tuple = (-1, -1),
        softcap: float = 0.0,
        dropout_p: float = 0.0,
        deterministic: bool = False,
    ) -> torch.Tensor:
        """Serve one call in the op layout (batch, seqlen, nheads, headdim): :func:`gproj_attn_func`
        with this site's ``fix`` and name (on q, k, v cast to ``compute_dtype`` when that is bf16 or
        fp16), or, with ``compute_dtype`` fp32 or fp64, SDPA in that dtype (autocast
        off, bottom-right causal mask and the key padding ``j < seqlens_k[b]`` as one boolean mask, GQA
        heads repeated) cast back to q's dtype. ``seqlens_k``: None or an integer (batch,) tensor of
        key lengths (right padding), passed to the op only when given; ``window_size``, ``softcap`` as the
        op takes them (with an fp32/fp64 ``compute_dtype`` such calls run the op in that dtype with fix "none" and
        dS unrounded: SDPA has no softcap); ``dropout_p`` (attention dropout, passed to the op only when > 0; SDPA's own dropout
        in the fp32/fp64 path); ``deterministic`` (the op's, passed only when True; the fp32/fp64 SDPA path is
        governed by ``torch.use_deterministic_algorithms`` alone)."""
        dt = self.compute_dtype
        extra = {} if seqlens_k is None else {"seqlens_k": seqlens_k}
        if dropout_p:
            extra["dropout_p"] = dropout_p
        if deterministic:
            extra["deterministic"] = True
        featured = tuple(window_size) != (-1, -1) or bool(softcap)
        if featured:
            extra.update(window_size=tuple(window_size), softcap=softcap)
        wide = self.sdpa_arm  # whatever q's dtype (under 32-true q is already fp32)
        if not wide or featured:
            qs, ks, vs = (q, k, v) if dt is None else (t.to(dt) for t in (q, k, v))
            o = gproj_attn_func()(
                qs, ks, vs, softmax_scale=softmax_scale, causal=causal, fix="none" if wide else self.fix,
                stats_name=display_path(self.name), ds_format="bf16" if wide else self.ds_format, **extra,
            )
            return o if dt is None else o.to(q.dtype)  # without a cast, the op's output dtype is autocast's
        if RECORDER.enabled:  # the op's forward statistics, so a monitor sees this site's mean key too
            ops.record_forward_stats(display_path(self.name), q, k, seqlens_k)
        group = q.shape[2] // k.shape[2]
        qs, ks, vs = (t.transpose(1, 2).to(dt) for t in (q, k, v))
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        mask = causal_bool(q.shape[1], k.shape[1], q.device) if causal else None
        if seqlens_k is not None:
            keys = torch.arange(k.shape[1], device=q.device)[None, :] < seqlens_k.to(q.device)[:, None]
            keys = keys[:, None, :, None]
            # padded keys and values are zeroed, not only masked: SDPA multiplies their zero weight
            # by them, and a NaN or inf there would reach every row (the op never reads them)
            ks, vs = torch.where(keys, ks, 0.0), torch.where(keys, vs, 0.0)
            keys = keys.transpose(2, 3)
            mask = keys if mask is None else keys & mask
        with torch.autocast(q.device.type, enabled=False):
            scale = None if softmax_scale is None else float(softmax_scale)  # SDPA takes a float only (not a (1,) tensor)
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                                 dropout_p=dropout_p)
        return o.transpose(1, 2).to(q.dtype)

    def attention_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale=None,
        causal: bool = False,
        window_size: tuple = (-1, -1),
        softcap: float = 0.0,
        dropout_p: float = 0.0,
        deterministic: bool = False,
    ) -> torch.Tensor:
        """Serve one packed-sequence call, q (total_q, nheads, headdim), k, v (total_k, nheads_k,
        headdim): :func:`gproj_attn_varlen_func` with this site's ``fix`` and name, or, with
        ``compute_dtype`` set, :meth:`attention` one sequence at a time (bottom-right causal and window
        within each), cast back to q's dtype. ``window_size``, ``softcap``, ``dropout_p``, ``deterministic``: as
        :meth:`attention` takes them."""
        if self.compute_dtype is None or (q.dtype == self.compute_dtype and not self.sdpa_arm):
            extra = {"dropout_p": dropout_p} if dropout_p else {}
            if deterministic:
                extra["deterministic"] = True
            return gproj_attn_varlen_func()(
                q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, fix=self.fix,
                stats_name=display_path(self.name), ds_format=self.ds_format, window_size=tuple(window_size),
                softcap=softcap, **extra,
            )
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
                part = slice(cq[b], cq[b + 1])
                out[part] = self.attention(q[None, part], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                           softcap=softcap, dropout_p=dropout_p, deterministic=deterministic)[0]
        return out

    def __repr__(self) -> str:
        return (f"Site({self.name!r}, fix={self.fix!r}, served={self.served}, fallbacks={self.fallbacks}, "
                f"strict={self.strict})")


def causal_bool(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """(n_q, n_k) bool, True where query i sees key j under the bottom-right causal rule
    ``j <= i + n_k - n_q`` (equal to SDPA's top-left ``is_causal`` mask when n_q == n_k)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q)
