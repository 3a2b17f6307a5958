"""Attention implementations compared by benchmarks/fidelity.py and benchmarks/attention.py.

Every method maps bf16 (batch, seqlen, nheads, headdim) q, k, v (k, v may have fewer heads) and an
incoming gradient do to (o, dq, dk, dv), and offers separate forward / backward closures for timing.

- ``gproj``, ``gproj_fold``, ``none``, ``gproj_uniform``: our Triton kernels (kernels/attention_*.py);
  ``gproj_fold`` is fix="gproj" with the dK term folded into dS (DESIGN.md §4.1); ``*_e4m3``, ``*_e5m2``
  round dS to FP8 significands (``ds_format``, DESIGN.md §11).
- ``cudnn``, ``sdpa_flash``: torch SDPA restricted to one backend (GQA: k, v repeated, autograd sums).
- ``fa4``: flash-attn-4's CuTe kernels (``flash_attn.cute.flash_attn_func``, Hopper path) if importable.
- ``sdpa_mask``: torch SDPA with the causal mask / sliding window as an explicit boolean ``attn_mask``
  (whichever backend torch picks for a masked call); with ``fa4``, the anchors that express a window.

Our methods take ``window_size`` / ``softcap`` (flash-attn's, kernels/reference.py); :func:`unsupported`
says which anchors cannot express them.

Also the float64 reference and the error metrics that benchmarks/fidelity.py and
benchmarks/captured_fidelity.py compare the methods with. The kernels are imported when an ``Ours`` is
made, so this module imports with torch alone (captured_fidelity.py loads the kernels itself first).
"""

from __future__ import annotations

import torch

OURS = {
    "gproj": dict(fix="gproj", dk_fold=False),
    "gproj_fold": dict(fix="gproj", dk_fold=True),
    "none": dict(fix="none", dk_fold=False),
    "gproj_uniform": dict(fix="gproj_uniform", dk_fold=False),
    # dS rounded to FP8 significands (ds_format, DESIGN.md §11): the accelerated-test formats
    "gproj_e4m3": dict(fix="gproj", dk_fold=False, ds_format="e4m3"),
    "none_e4m3": dict(fix="none", dk_fold=False, ds_format="e4m3"),
    "gproj_e5m2": dict(fix="gproj", dk_fold=False, ds_format="e5m2"),
    "none_e5m2": dict(fix="none", dk_fold=False, ds_format="e5m2"),
}


def fa4_func():
    """flash_attn.cute.flash_attn_func, or None when flash-attn-4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore
        return flash_attn_func
    except Exception:
        return None


def available(name: str) -> bool:
    if name in OURS:
        return True
    if not torch.cuda.is_available():
        return False
    if name == "fa4":
        return fa4_func() is not None
    return name in ("cudnn", "sdpa_flash", "sdpa_mask")


def unsupported(name: str, window_size=(-1, -1), softcap: float = 0.0, dropout_p: float = 0.0,
                timing: bool = False) -> str | None:
    """Why method ``name`` cannot run with this window / softcap / dropout, or None when it can.

    ``fa4`` takes flash-attn's ``window_size`` and ``softcap`` (its tanh is ``tanh.approx.f32``: FA4's
    utils.create_softcap_scoremod, fastmath); ``sdpa_mask`` a window. Dropout: ours only, except with ``timing``
    (benchmarks/attention.py), where ``cudnn`` and ``sdpa_flash`` take SDPA's ``dropout_p`` (their mask comes from
    torch's generator, so there is no common float64 reference for fidelity)."""
    if name in OURS:
        return None
    if dropout_p and not (timing and name in ("cudnn", "sdpa_flash")):
        return f"{name}: its dropout mask comes from another generator (no common float64 reference)"
    if softcap and name != "fa4":
        return f"{name}: no logit softcap in this path"
    if tuple(window_size) != (-1, -1) and name not in ("sdpa_mask", "fa4"):
        return f"{name}: no sliding window in this path (sdpa_mask and fa4 express it)"
    return None


def visible_mask(nq, nk, causal, window_size=(-1, -1), device=None):
    """(nq, nk) bool, True where query i sees key j: flash-attn's bottom-right aligned window
    i + nk − nq − left <= j <= i + nk − nq + right (−1 unbounded; ``causal`` sets right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(nq, device=device)[:, None] + (nk - nq)
    cols = torch.arange(nk, device=device)[None, :]
    seen = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= cols >= rows - left
    if right >= 0:
        seen &= cols <= rows + right
    return seen


class Ours:
    """Forward/backward closures over our kernels (stats optional)."""

    def __init__(self, name, q, k, v, do, causal, want_stats=False, grad_dtype=None, window_size=(-1, -1),
                 softcap=0.0, dropout_p=0.0, dropout_seed=0, dropout_offset=0, seqlens_k=None):
        from lightning_gproj.kernels import attention_bwd, attention_fwd
        self.feat = dict(window_size=window_size, softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                         dropout_offset=dropout_offset, seqlens_k=seqlens_k)
        self.F, self.B = attention_fwd, attention_bwd
        self.kw = OURS[name]
        self.q, self.k, self.v, self.do, self.causal = q, k, v, do, causal
        self.tau = q.shape[-1] ** -0.5
        self.want_stats = want_stats
        self.grad_dtype = grad_dtype
        self.state = None

    def fwd(self):
        self.state = self.F.forward(self.q, self.k, self.v, self.tau, self.causal, **self.feat)
        return self.state

    def bwd(self):
        o, m, l2 = self.state
        return self.B.backward(self.do, self.q, self.k, self.v, o, m, l2, self.tau, self.causal, self.kw["fix"],
                               self.want_stats, dk_fold=self.kw["dk_fold"], grad_dtype=self.grad_dtype,
                               ds_format=self.kw.get("ds_format", "bf16"), **self.feat)

    def fwd_bwd(self):
        self.fwd()
        return self.bwd()

    def run(self):
        o, _, _ = self.fwd()
        dq, dk, dv, extras = self.bwd()
        return o, dq, dk, dv, extras


class Anchor:
    """SDPA (one backend, or a boolean mask) or FA4 through autograd."""

    def __init__(self, name, q, k, v, do, causal, window_size=(-1, -1), softcap=0.0, dropout_p=0.0, timing=False):
        reason = unsupported(name, window_size, softcap, dropout_p, timing=timing)
        if reason is not None:
            raise ValueError(reason)
        self.name = name
        self.causal = causal
        self.window_size = tuple(window_size)
        self.softcap = softcap
        self.dropout_p = dropout_p
        self.tau = q.shape[-1] ** -0.5
        self.q = q.detach().clone().requires_grad_()
        self.k = k.detach().clone().requires_grad_()
        self.v = v.detach().clone().requires_grad_()
        self.do = do
        self.out = None

    def _forward(self):
        q, k, v = self.q, self.k, self.v
        if self.name == "fa4":
            left, right = self.window_size
            res = fa4_func()(q, k, v, softmax_scale=self.tau, causal=self.causal, softcap=self.softcap,
                             window_size=(None if left < 0 else left, None if right < 0 else right))
            return res[0] if isinstance(res, (tuple, list)) else res
        from torch.nn.attention import SDPBackend, sdpa_kernel
        g = q.shape[2] // k.shape[2]
        if g > 1:
            k = k.repeat_interleave(g, dim=2)
            v = v.repeat_interleave(g, dim=2)
        if self.name == "sdpa_mask":
            mask = visible_mask(q.shape[1], k.shape[1], self.causal, self.window_size, q.device)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.tau
            )
            return o.transpose(1, 2)
        be = SDPBackend.CUDNN_ATTENTION if self.name == "cudnn" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel(be):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal, scale=self.tau,
                dropout_p=self.dropout_p)
        return o.transpose(1, 2)

    def fwd(self):
        with torch.no_grad():
            return self._forward()

    def fwd_graph(self):
        self.out = self._forward()
        return self.out

    def bwd(self):
        return torch.autograd.grad(self.out, (self.q, self.k, self.v), self.do, retain_graph=True)

    def fwd_bwd(self):
        out = self._forward()
        return torch.autograd.grad(out, (self.q, self.k, self.v), self.do)

    def run(self):
        out = self._forward()
        dq, dk, dv = torch.autograd.grad(out, (self.q, self.k, self.v), self.do)
        return out.detach(), dq, dk, dv, {}


def make(name, q, k, v, do, causal, window_size=(-1, -1), softcap=0.0, dropout_p=0.0, timing=False, **kw):
    """Method ``name`` on these inputs; ``kw`` (want_stats, grad_dtype, dropout_seed / dropout_offset, seqlens_k) for
    ours only. ``timing`` (benchmarks/attention.py): an anchor given ``dropout_p`` draws SDPA's own mask. Raises
    ValueError for an anchor that cannot express ``window_size`` / ``softcap`` / ``dropout_p`` (:func:`unsupported`)
    or is given one of ``kw``."""
    if name in OURS:
        return Ours(name, q, k, v, do, causal, window_size=window_size, softcap=softcap, dropout_p=dropout_p, **kw)
    if kw:
        raise ValueError(f"{name}: {sorted(kw)} apply to our kernels only")
    return Anchor(name, q, k, v, do, causal, window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                  timing=timing)


def attn_flops(b, h, nq, nk, d, causal, mode):
    """DESIGN.md §7: forward 4·B·H·Nq·Nk·d (× ½ causal), backward 2.5 × forward."""
    f = 4.0 * b * h * nq * nk * d * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def env_info() -> dict:
    import platform

    import triton
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    info["fa4"] = fa4_func() is not None
    return info


def f64_reference(q, k, v, do, tau, causal, window_size=(-1, -1), softcap=0.0, dropout_p=0.0, dropout_seed=0,
                  dropout_offset=0):
    """Plain softmax attention and its autograd gradients in float64 on the same bf16 inputs: (o, dq, dk, dv).

    ``window_size``: flash-attn's sliding window (:func:`visible_mask`); ``softcap`` > 0: the logits are
    softcap · tanh(τ q·k / softcap); ``dropout_p`` > 0: P times the keep mask our kernels draw for
    (``dropout_seed``, ``dropout_offset``) (kernels/reference.dropout_keep_mask), over 1 − p̂
    (kernels/reference.dropout_scale). A row that sees no key gets o = 0 and zero gradients."""
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    g = h // hk
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(g, dim=1)
    s = tau * qh @ kh.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = visible_mask(nq, nk, causal, window_size, q.device)
    # a large finite fill, not −inf, then × seen: a row without keys gets P = 0 and finite gradients
    p = torch.softmax(s.masked_fill(~seen, -1e300), dim=-1) * seen
    if dropout_p:
        from lightning_gproj.kernels.reference import dropout_keep_mask, dropout_scale
        keep = dropout_keep_mask(dropout_seed, dropout_offset, dropout_p, b, h, nk, (0, nq), (0, nk), q.device)
        p = p * keep * dropout_scale(dropout_p)
    o = (p @ vh).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), do.double())
    return o.detach(), dq, dk, dv


def frob_pairs(x, ref):
    """Relative Frobenius error per (sequence, head): a flat tensor of B·H values; x, ref (B, N, H, d)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm(dim=(1, 3)) / ref.norm(dim=(1, 3)).clamp(min=1e-300)).flatten().cpu()


def row_errors(x, ref):
    """Row-relative errors ‖x_i − x_ref,i‖ / ‖x_ref,i‖, flat; rows whose reference is exactly 0 skipped."""
    x, ref = x.double(), ref.double()
    num, den = (x - ref).norm(dim=-1), ref.norm(dim=-1)
    keep = den > 0
    return (num[keep] / den[keep]).cpu()


def c2_pairs(dk):
    """‖Σ_j dK_j‖ / ‖dK‖_F per (sequence, head): a flat tensor; dk (B, N, H, d)."""
    dk = dk.double()
    return (dk.sum(dim=1).norm(dim=-1) / dk.norm(dim=(1, 3)).clamp(min=1e-300)).flatten().cpu()
