"""Seeing attention calls on sampled steps: the C2 residual hook and the probe (DESIGN.md §8).

:class:`AttentionCapture` is a ``TorchFunctionMode`` that :class:`~lightning_gproj.callbacks.ZeroSumMonitor`
enters around the forward of sampled steps only (``on_train_batch_start`` → ``on_before_backward``).
It sees

* every ``F.scaled_dot_product_attention`` call that is *not* served by a swapped module (unswapped
  models, FA-style SDPA, fallbacks), named after the innermost module running (global module
  forward hooks, also installed on sampled steps only), and
* every dense call of the GProj op (``lightning_gproj::attn_fwd``, from swapped modules), named by its
  ``stats_name`` (packed-sequence calls, ``gproj_attn_varlen_func``, get no C2 hook).

For each it registers a hook on the gradient of k: C2 residual = ‖Σ_j dK_j‖₂ / ‖dK‖_F, the norm of the
key gradient summed over key positions (per batch row and head, then the L2 norm over all of them)
relative to the Frobenius norm of the key gradient. Exactly 0 in exact arithmetic for any mask, dropout
or kernel (Σ_j dK_j = τ Σ_i r_i q_i and every r_i = Σ_j dS_ij = 0); any value is the kernel's
rounding. Dimensionless.

Probe (SDPA calls only): on a probe step the first call of the chosen layer is captured on a small
slice — batch row 0, the first ``heads`` query heads (their k/v heads under GQA, repeated), the first
``queries`` queries (keys cut to the same length under ``is_causal``, which cannot see further), the
mask sliced alike — together with the incoming gradient dO of that slice (a hook on the call's output).
:func:`probe_backward` then recomputes the slice's dQ with the user's kernel (SDPA autograd in the
captured dtype and autocast state) and in float64, see its docstring. Training itself is untouched.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA = F.scaled_dot_product_attention


def _signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _op_overload() -> Any:
    try:
        return torch.ops.lightning_gproj.attn_fwd.default
    except (AttributeError, RuntimeError):  # op not registered (lightning_gproj.ops not imported)
        return None


@dataclasses.dataclass
class ProbeCapture:
    """One captured slice: q, k, v (SDPA layout (1, heads, seqlen, headdim), k/v heads repeated to the
    query heads), the sliced mask, the call's is_causal/scale, the autocast dtype at the call (None if
    off) and, once the backward reached it, dO of the slice."""

    layer: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    scale: Optional[float]
    autocast_dtype: Optional[torch.dtype]
    do: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Probe numbers (0-dim float64 tensors; ``dq_error_heads``: one per probed head).

    ``dq_error``: mean over the probed heads of ‖dQ_kernel − dQ_fp64‖_F / ‖dQ_fp64‖_F (per head, over
    the sliced queries and head dim); ``dq_error_max``: their maximum; ``leak_ratio``: ‖L‖_F /
    ‖dQ_fp64‖_F where row i of L is the projection of the row's dQ error onto τ (P K)_i — the part of
    the error that a per-row offset of dS (r_i ≠ 0) produces, i.e. DESIGN.md §8's λ measured from the
    outside, without the kernel's r."""

    dq_error: torch.Tensor
    dq_error_max: torch.Tensor
    leak_ratio: torch.Tensor
    dq_error_heads: torch.Tensor


def reference_dq(q, k, v, do, attn_mask=None, is_causal=False, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ, τ·P·K) in float64 by the explicit formulas, SDPA layout and mask semantics (``is_causal``
    top-left; bool mask True = attend; float mask added to the scores)."""
    q, k, v, do = (t.detach().to(torch.float64) for t in (q, k, v, do))
    tau = scale if scale is not None else q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-1, -2)) * tau
    if is_causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: zero
    o = torch.matmul(p, v)
    dp = torch.matmul(do, v.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    return tau * torch.matmul(ds, k), tau * torch.matmul(p, k)


def probe_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    autocast_dtype: Optional[torch.dtype] = None,
) -> ProbeResult:
    """dQ of one captured slice by the user's kernel (``F.scaled_dot_product_attention`` autograd on the
    captured tensors, in their dtype, under the captured autocast state) against float64
    (:func:`reference_dq`). SDPA layout (batch, heads, seqlen, headdim), equal head counts."""
    device = q.device.type
    with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        qk = q.detach().clone().requires_grad_(True)
        o = SDPA(qk, k.detach(), v.detach(), attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        (dq_kernel,) = torch.autograd.grad(o, qk, do.to(o.dtype))
    dq, pk = reference_dq(q, k, v, do, attn_mask, is_causal, scale)
    err = dq_kernel.detach().to(torch.float64) - dq
    tiny = torch.finfo(torch.float64).tiny
    heads = err.flatten(2).norm(dim=-1) / dq.flatten(2).norm(dim=-1).clamp_min(tiny)  # (batch, heads)
    coef = (err * pk).sum(-1, keepdim=True) / (pk * pk).sum(-1, keepdim=True).clamp_min(tiny)
    leak = coef * pk
    return ProbeResult(
        dq_error=heads.mean(),
        dq_error_max=heads.max(),
        leak_ratio=leak.norm() / dq.norm().clamp_min(tiny),
        dq_error_heads=heads.flatten(),
    )


def slice_call(q, k, v, attn_mask, is_causal, enable_gqa, heads: int, queries: int):
    """The probe slice of one SDPA call (see module docstring), detached copies; None if the call's
    shapes are not 4-D (batch, heads, seqlen, headdim)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return None
    b, hq, nq, _ = q.shape
    hk = k.shape[1]
    if hq % hk:
        return None
    nh, nq_s = min(heads, hq), min(queries, nq)
    kv_heads = torch.arange(nh, device=k.device) // (hq // hk)
    qs = q[:1, :nh, :nq_s]
    ks, vs = k[:1].index_select(1, kv_heads), v[:1].index_select(1, kv_heads)
    if is_causal:  # top-left: query i < nq_s sees keys j <= i only
        ks, vs = ks[:, :, :nq_s], vs[:, :, :nq_s]
    mask = None
    if attn_mask is not None:
        if attn_mask.dim() > 4:
            return None
        full = attn_mask.expand(b, hq, nq, k.shape[2])
        mask = full[:1, :nh, :nq_s].detach().clone()
    return tuple(t.detach().clone() for t in (qs, ks, vs)) + (mask,)


def compiled_fullgraph(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs under ``torch.compile(..., fullgraph=True)``, whole (``trainer.fit(torch.compile(model,
    fullgraph=True))``: Lightning keeps the compile context on the module as ``_compiler_ctx``) or in part (a submodule
    replaced by its compiled wrapper, ``self.attn = torch.compile(self.attn, fullgraph=True)``). Read from Dynamo's
    frame callback (its ``_one_graph``); False where that is absent (not compiled, or a torch that keeps it
    elsewhere), or a ``forward`` replaced by a compiled function (``m.forward = torch.compile(m.forward,
    fullgraph=True)``: its wrapper's closure holds the callback)."""
    ctx = getattr(module, "_compiler_ctx", None)
    callbacks = [getattr(ctx.get("dynamo_ctx") if isinstance(ctx, dict) else None, "callback", None)]
    for m in module.modules():
        callbacks.append(getattr(getattr(m, "dynamo_ctx", None), "callback", None) if hasattr(m, "_orig_mod") else None)
        forward = m.__dict__.get("forward")
        if hasattr(forward, "_torchdynamo_orig_callable"):
            try:
                callbacks.append(inspect.getclosurevars(forward).nonlocals.get("callback"))
            except (TypeError, ValueError):
                pass
    return any(getattr(cb, "_one_graph", False) for cb in callbacks)


class AttentionCapture(TorchFunctionMode):
    """See the module docstring. ``names``: ``{id(module): path}`` of the model's modules; ``layers``:
    the SDPA layer names seen so far, in order of first appearance (appended to, shared across steps);
    ``probe_layer``: the layer to probe this step ("" = the first SDPA call seen that ``probe_filter``
    accepts; None = no probe)."""

    def __init__(
        self,
        names: dict[int, str],
        layers: list[str],
        *,
        c2: bool,
        probe_layer: Optional[str] = None,
        probe_heads: int = 2,
        probe_queries: int = 512,
        probe_filter: Optional[Callable[[str], bool]] = None,
    ) -> None:
        super().__init__()
        self.names = names
        self.layers = layers
        self.c2 = c2
        self.probe_layer = probe_layer
        self.probe_heads = probe_heads
        self.probe_queries = probe_queries
        self.probe_filter = probe_filter or (lambda name: True)
        #: ``{layer: [(‖Σ_j dK_j‖, ‖dK‖_F), ...]}`` (0-dim fp32/fp64 tensors), one per call whose k got a gradient.
        self.c2_terms: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.probe: Optional[ProbeCapture] = None
        self.active = False
        self._stack: list[torch.nn.Module] = []
        self._handles: list[Any] = []
        self._op = _op_overload()

    # ------------------------------------------------------------------ enter / exit (hook-driven)

    def start(self) -> None:
        from torch.nn.modules import module as module_hooks

        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._push),
            module_hooks.register_module_forward_hook(self._pop, always_call=True),
        ]
        self.__enter__()
        self.active = True

    def stop(self) -> None:
        """Leave the mode and remove the module hooks (idempotent). Gradient hooks stay: they fire in
        the backward that follows."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def _push(self, module, args) -> None:
        self._stack.append(module)

    def _pop(self, module, args, output) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _current_name(self) -> str:
        for module in reversed(self._stack):
            name = self.names.get(id(module))
            if name is not None:
                return name or "<root>"
        return "attention"

    # ------------------------------------------------------------------ interception

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            out = func(*args, **kwargs)
            try:
                self._on_sdpa(out, args, kwargs)
            except TypeError:  # arguments SDPA accepted but we do not parse: not ours to judge
                pass
            return out
        if self._op is not None and func is self._op:
            out = func(*args, **kwargs)
            # Dense calls only: a packed call's k is (total_k, heads, headdim), its sequences' keys on dim 0.
            if self.c2 and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 4:
                name = args[6] if len(args) > 6 else kwargs.get("stats_name", "attention")
                self._hook_c2(name, args[1], seq_dim=1)  # op layout (batch, seqlen, heads, headdim)
            return out
        return func(*args, **kwargs)

    def _on_sdpa(self, out: torch.Tensor, args: tuple, kwargs: dict) -> None:
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _signature(*args, **kwargs)
        name = self._current_name()
        if name not in self.layers:
            self.layers.append(name)
        if self.c2 and isinstance(k, torch.Tensor) and k.dim() >= 2:
            self._hook_c2(name, k, seq_dim=k.dim() - 2)
        wanted = self.probe_layer is not None and self.probe is None
        chosen = name == self.probe_layer or (self.probe_layer == "" and self.probe_filter(name))
        if wanted and chosen and dropout_p == 0.0 and out.requires_grad:
            sliced = slice_call(q, k, v, mask, is_causal, enable_gqa, self.probe_heads, self.probe_queries)
            if sliced is None:
                return
            qs, ks, vs, ms = sliced
            device = q.device.type
            dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            cap = ProbeCapture(name, qs, ks, vs, ms, bool(is_causal), scale, dt)
            nh, nq = qs.shape[1], qs.shape[2]

            def grab(grad: torch.Tensor) -> None:
                cap.do = grad.detach()[:1, :nh, :nq].clone()

            out.register_hook(grab)
            self.probe = cap

    def _hook_c2(self, name: str, k: torch.Tensor, seq_dim: int) -> None:
        if not k.requires_grad:
            return
        terms = self.c2_terms.setdefault(name, [])

        def c2(grad: torch.Tensor) -> None:
            g = grad.detach()
            g = g.to(torch.promote_types(g.dtype, torch.float32))  # 16-bit summed in fp32, fp64 kept
            terms.append((torch.linalg.vector_norm(g.sum(dim=seq_dim)), torch.linalg.vector_norm(g)))

        k.register_hook(c2)

    # ------------------------------------------------------------------ results

    def c2_residuals(self) -> dict[str, torch.Tensor]:
        """``{layer: mean over the calls of ‖Σ_j dK_j‖ / ‖dK‖_F}`` (0-dim tensors), and clears them. A call
        whose dK is all zero (every query row sees one key: dS ≡ 0) has no residual to speak of and is left
        out of the mean (NaN when every call of the layer is such a call); a call whose dK holds a NaN is not
        left out (the mean is then NaN)."""
        out = {}
        for name, terms in self.c2_terms.items():
            if terms:
                num, den = (torch.stack(x) for x in zip(*terms))
                kept = den != 0  # a NaN dK (den NaN) is kept: the layer's residual is then NaN, as it should read
                ratios = torch.where(kept, num / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0)
                out[name] = ratios.sum() / kept.sum()
        self.c2_terms = {}
        return out


