"""Route ``F.scaled_dot_product_attention`` calls made inside chosen modules to ``gproj_attn_func``.

A module is a target when a function defined on its class (``forward`` or a helper method, nested
functions included) reaches ``scaled_dot_product_attention`` (:func:`calls_sdpa`: by name, a global of its module
bound to it, a partial, a closure variable, a default argument, a class attribute). Its instance ``forward`` is replaced by
:class:`SDPAForward`, which runs the original forward inside :class:`SDPAMode`, a
``TorchFunctionMode`` that intercepts SDPA and serves exactly the calls whose meaning it understands;
every other call runs the original SDPA (one :class:`GProjFallbackWarning` per module). Because the
wrapper sits on the module's ``forward``, activation checkpointing that recomputes the module runs
the same code again. Parameters and buffers are untouched.

Layouts: SDPA takes (batch, nheads, seqlen, headdim); the op takes (batch, seqlen, nheads, headdim).
The mapping is a transpose (a strided view, no copy); the output is returned as the transposed view of
the op's output, which is what SDPA's flash backend returns too.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ._common import Guard, Site, causal_bool, dropout_reason, op_reason

#: The original SDPA (the builtin that ``TorchFunctionMode`` hands to ``__torch_function__``).
SDPA = F.scaled_dot_product_attention
_NAME = "scaled_dot_product_attention"


def _codes(code: types.CodeType):
    """``code`` and the code objects nested in it (inner functions, comprehensions), depth first."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _code_names(code: types.CodeType) -> set[str]:
    """The names (globals and attributes alike) that ``code`` and the code nested in it use."""
    return {name for c in _codes(code) for name in c.co_names}


#: Instructions that read a name as a global (not an attribute, a local or a free variable).
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


def _global_names(code: types.CodeType) -> set[str]:
    """Names the code (and the code nested in it) loads as globals: ``co_names`` also holds attribute names
    (``self.attn``), which a global of the same name (``... import scaled_dot_product_attention as attn``) must
    not turn into an SDPA call."""
    return {ins.argval for c in _codes(code) for ins in dis.get_instructions(c) if ins.opname in _GLOBAL_LOADS}


def _functions_of(obj: Any):
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset):
            if f is not None:
                yield from _functions_of(f)
        return
    try:
        obj = inspect.unwrap(obj) if callable(obj) else obj
    except ValueError:  # a __wrapped__ loop: not a function of ours to read
        return
    if isinstance(obj, types.FunctionType):
        yield obj


def _is_sdpa(obj: Any) -> bool:
    """``obj`` is SDPA itself, or a ``functools.partial``, staticmethod or classmethod of it."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    while isinstance(obj, functools.partial):
        obj = obj.func
    return obj is SDPA


def _reaches_sdpa(fn: types.FunctionType) -> bool:
    """``fn`` (or a function nested in it) names SDPA, or holds it: a global it loads, a default argument or a
    closure variable bound to SDPA (or a partial of it)."""
    code = fn.__code__
    if _NAME in _code_names(code) or any(_is_sdpa(fn.__globals__.get(name)) for name in _global_names(code)):
        return True
    bound = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    for cell in fn.__closure__ or ():
        try:
            bound.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return any(_is_sdpa(x) for x in bound)


def calls_sdpa(module: nn.Module) -> bool:
    """True if a function defined on ``type(module)`` (below ``nn.Module``) reaches SDPA: names it
    (``F.scaled_dot_product_attention``, ``from torch.nn.functional import scaled_dot_product_attention``), loads a
    global of its module bound to it (not an attribute of that name: ``... import scaled_dot_product_attention as
    sdpa``, ``attend = F.scaled_dot_product_attention``, a ``functools.partial`` of it) or holds it as a default
    argument or closure variable; or a class attribute is SDPA (``attend = staticmethod(F.scaled_dot_product_attention)``).

    Reads code objects (``co_names`` of the functions and of the functions nested in them), the functions' globals,
    defaults and closures, not source, so it works for classes defined anywhere. Calls through helpers defined
    elsewhere (e.g. Hugging Face's attention interface) are not seen; ``swap_attention(catch_all=True)`` covers them.
    """
    for cls in type(module).__mro__:
        if cls is nn.Module or cls is object or cls.__module__.startswith("torch.nn."):
            continue
        for value in vars(cls).values():
            if _is_sdpa(value) or any(_reaches_sdpa(fn) for fn in _functions_of(value)):
                return True
    return False


def _signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _autocast_unifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True if autocast casts q, k, v to one dtype, as it does for SDPA and the op alike: fp32 and
    autocast-dtype inputs (e.g. fp32 rotary-embedded q, k with a bf16 v) under an enabled autocast."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return False
    allowed = (torch.float32, torch.get_autocast_dtype(device_type))
    return all(t.dtype in allowed for t in (q, k, v))


def key_padding_lengths(mask: torch.Tensor, n_q: int, n_k: int, causal: bool,
                        sdpa_causal: bool = False) -> Optional[torch.Tensor]:
    """Per-batch key lengths L (int64, (mask batch,)) if the boolean SDPA mask (True = attend),
    broadcast over heads and queries, equals ``j < L[b]`` (right key padding; with ``causal``
    (Nq == Nk): causal & ``j < L[b]``), with every L[b] >= 1; else None. ``sdpa_causal``: the call
    has ``is_causal=True``, so SDPA masks the keys above the diagonal itself and the mask's entries
    there are not compared; without it they must be False (a mask True there — e.g. a prefix-LM
    block — is not causal attention).

    ``mask`` is 4-D (batch or 1, heads or 1, Nq or 1, Nk). The last query row sees every key under
    either rule, so L is read there and the whole mask is then compared with the one L implies.
    Reads the mask's values (a device sync).
    """
    lengths = mask[:, 0, -1, :].sum(dim=-1)  # (batch or 1,)
    if not bool((lengths >= 1).all()):
        return None
    expected = (torch.arange(n_k, device=mask.device)[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        visible = causal_bool(n_q, n_k, mask.device)
        same = mask == (expected & visible)
        ok = bool((same | ~visible).all() if sdpa_causal else same.all())
    else:
        ok = bool((mask == expected).all())
    return lengths if ok else None


def plan(args: tuple, kwargs: dict) -> tuple[Optional[str], bool, Optional[torch.Tensor]]:
    """Decide how to serve one SDPA call: ``(reason, causal, seqlens_k)``; ``reason`` is None when the
    op can reproduce SDPA exactly (up to rounding) with ``causal`` and key lengths ``seqlens_k``
    (None: no key padding; else an int64 (batch,) tensor on the inputs' device), else it says why not.

    Served: 4-D q, k, v of one dtype (or fp32 mixed with the autocast dtype under autocast) and
    device, equal batch, equal headdim for v (a multiple of 8
    up to the op's ``MAX_HEAD_DIM``), ``dropout_p`` in [0, 1) (the op's own Philox mask: the same
    distribution as SDPA's, not the same draws), ``scale``, GQA with ``enable_gqa=True``, and
    ``attn_mask`` / ``is_causal`` one of:

    * no mask (``is_causal`` only with Nq == Nk: SDPA's mask is top-left aligned, the op's bottom-right);
    * a bool mask broadcastable to (batch, heads, Nq, Nk) whose values are exactly all-True or the
      causal mask (Nq <= Nk);
    * a bool right key-padding mask — broadcast from (batch, 1, 1, Nk) (or (1, 1, 1, Nk)), each batch
      row True on a non-empty prefix of the keys and False after it — served as ``seqlens_k``; with
      ``is_causal=True``, or as a (batch, 1, Nq, Nk) mask equal to causal & padding, when Nq == Nk
      (``is_causal`` with a mask: SDPA in torch 2.13 applies both, causal & mask, on CPU);
    * ``is_causal=True`` with an all-True mask (Nq == Nk).

    Left padding, holes, rows with no valid key and anything else fall back. Reading a mask's values
    synchronizes with the device.
    """
    try:
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _signature(*args, **kwargs)
    except TypeError as err:
        return f"unrecognized arguments ({err})", False, None
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value are not all tensors", False, None
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"inputs are not 4-D (query {tuple(q.shape)}, key {tuple(k.shape)})", False, None
    if not (q.device == k.device == v.device):
        return "query/key/value differ in device", False, None
    if not (q.dtype == k.dtype == v.dtype) and not _autocast_unifies(q, k, v):
        return f"query/key/value differ in dtype ({q.dtype}, {k.dtype}, {v.dtype})", False, None
    reason = dropout_reason(dropout_p)
    if reason is not None:
        return reason, False, None
    (b, h_q, n_q, d), (bk, h_k, n_k, dk) = q.shape, k.shape
    if not (b == bk == v.shape[0]) or v.shape[1] != h_k or v.shape[2] != n_k or dk != d:
        return f"shapes need broadcasting or differ (query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)})", False, None
    if v.shape[3] != d:
        return f"value headdim {v.shape[3]} differs from query headdim {d}", False, None
    if h_k != h_q and not (enable_gqa and h_q % h_k == 0):
        return f"key heads {h_k} != query heads {h_q} without enable_gqa", False, None
    reason = op_reason(d, q.numel(), k.numel(), scale)
    if reason is not None:
        return reason, False, None
    if is_causal and n_q != n_k:
        return (
            f"is_causal with Nq={n_q} != Nk={n_k} (SDPA aligns the causal mask top-left, the op "
            f"bottom-right)"
        ), False, None
    if mask is None:
        return None, bool(is_causal), None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return f"attn_mask of dtype {getattr(mask, 'dtype', type(mask).__name__)} (only boolean causal / key-padding masks are served)", False, None
    # broadcast to (batch, heads, Nq, Nk) as SDPA does; (batch, 1, 1, Nk) is a key-padding mask. A 1-D mask falls
    # back: SDPA itself refuses it (torch 2.13: IndexError), and the original's error is the user's to see.
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape) if 2 <= mask.dim() <= 4 else None
    if shape is None or shape[3] != n_k or any(s not in (1, t) for s, t in zip(shape[:3], (b, h_q, n_q))):
        return f"attn_mask of shape {tuple(mask.shape)}", False, None
    if mask.device != q.device:
        return "attn_mask on another device", False, None
    if bool(mask.all()):
        return None, bool(is_causal), None
    if not is_causal and n_q <= n_k and bool((mask == causal_bool(n_q, n_k, mask.device)).all()):
        return None, True, None
    mask4 = mask.reshape(shape)
    for causal in ((True,) if is_causal else (False, True)):
        if causal and n_q != n_k:
            continue
        lengths = key_padding_lengths(mask4, n_q, n_k, causal, sdpa_causal=bool(is_causal))
        if lengths is not None:
            lengths = lengths.expand(b) if lengths.shape[0] != b else lengths
            return None, causal, (None if bool((lengths == n_k).all()) else lengths)
    if shape[2] == 1:
        return "key-padding attn_mask that is not right padding (each batch row True on a non-empty prefix of the keys)", False, None
    if is_causal:
        return "attn_mask together with is_causal (the mask is not key padding)", False, None
    return ("boolean attn_mask is not the causal mask, nor right key padding alone or with causal (key padding: "
            "each batch row True on a non-empty prefix of the keys)"), False, None


def attend(site: Site, args: tuple, kwargs: dict) -> torch.Tensor:
    """Serve one SDPA call with the op, or fall back to the original SDPA (warning once per site)."""
    if site.keep:
        return SDPA(*args, **kwargs)
    reason, causal, seqlens_k = plan(args, kwargs)
    if reason is not None:
        site.fallback(reason)
        return SDPA(*args, **kwargs)
    q, k, v, _, dropout_p, _, scale, _ = _signature(*args, **kwargs)
    site.served += 1
    o = site.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal, seqlens_k=seqlens_k,
        dropout_p=float(dropout_p),
    )
    return o.transpose(1, 2)


class SDPAMode(TorchFunctionMode):
    """Intercepts ``F.scaled_dot_product_attention`` and hands it to :func:`attend` for ``site``."""

    def __init__(self, site: Site) -> None:
        super().__init__()
        self.site = site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA and Guard.depth == 0:
            Guard.depth += 1
            try:
                return attend(self.site, args, kwargs)
            finally:
                Guard.depth -= 1
        return func(*args, **kwargs)


class SDPAForward:
    """Instance ``forward`` of a swapped module: the original forward inside :class:`SDPAMode`.

    ``original`` is the instance-level forward that was there before (None: the class's forward).
    """

    def __init__(self, module: nn.Module, site: Site, original: Optional[Any]) -> None:
        self.module = module
        self.site = site
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with SDPAMode(self.site):
            if self.original is not None:
                return self.original(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)


def swapped_site(module: nn.Module) -> Optional[Site]:
    """The :class:`Site` of a module swapped by :func:`swap_module`, else None."""
    forward = module.__dict__.get("forward")
    return forward.site if isinstance(forward, SDPAForward) else None


def swap_module(
    module: nn.Module, name: str, fix: str, keep: bool = False, site: Optional[Site] = None
) -> Site:
    """Wrap ``module.forward`` so its SDPA calls go to the op, or with ``keep=True`` stay on the
    original SDPA even inside an enclosing catch-all (in place; idempotent: a second call only
    updates ``fix`` and ``keep``). ``site`` reuses an earlier :class:`Site`. Returns the site."""
    current = swapped_site(module)
    site = current or site or Site(name, type(module).__name__, fix)
    site.fix, site.keep = fix, keep
    if current is not None:
        return site
    module.forward = SDPAForward(module, site, module.__dict__.get("forward"))
    return site


def unswap_module(module: nn.Module) -> bool:
    """Undo :func:`swap_module`; returns whether the module was swapped."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, SDPAForward):
        return False
    if forward.original is None:
        del module.forward
    else:
        module.forward = forward.original
    return True
