"""The SDPA-registry kernels on the Triton path, under Triton's CPU interpreter; prints measurements as JSON.

Executed by tests/test_sdpa_registry_triton.py in a fresh subprocess with TRITON_INTERPRET=1 (``triton.jit``
picks compile-or-interpret when a kernel module is first imported). For each case and fix it runs
``torch.ops.aten._scaled_dot_product_flash_attention`` through torch's own autograd formula, with the
registry's kernels installed for the CPU key (``sdpa_registry._Handle("CPU")``, what activation installs
for CUDA), and :func:`lightning_gproj.gproj_attn_func` on the same inputs, and reports whether the two are
bit-identical, their errors against float64, and how many Triton launches served them. Not a test module.

Output: one JSON object on the last stdout line, {"cases": [...]}.
"""

from __future__ import annotations

import json
import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import lightning_gproj  # noqa: E402
from lightning_gproj import sdpa_registry  # noqa: E402
from lightning_gproj.kernels import attention_bwd, attention_fwd  # noqa: E402

from _fp64 import attention_fp64  # noqa: E402  (tests/ is this script's directory)

LAUNCHES = {"fwd": 0, "bwd": 0}
_fwd, _bwd = attention_fwd.forward, attention_bwd.backward


def _count(name, fn):
    def wrapped(*args, **kwargs):
        LAUNCHES[name] += 1
        return fn(*args, **kwargs)
    return wrapped


attention_fwd.forward = _count("fwd", _fwd)
attention_bwd.backward = _count("bwd", _bwd)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(shape, causal, fixes, seed):
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g).bfloat16()
    k = (torch.randn(b, hk, nk, d, generator=g) + 4.0).bfloat16()
    v = torch.randn(b, hk, nk, d, generator=g).bfloat16()
    do = torch.randn(b, h, nq, d, generator=g).bfloat16()
    tau = d ** -0.5
    fp64 = attention_fp64(*(x.transpose(1, 2) for x in (q, k, v, do)), tau, causal)  # flash layout in and out
    o64, dq64, dk64, dv64 = (x.transpose(1, 2) for x in fp64[:4])
    s = q.double() @ k.double().repeat_interleave(h // hk, dim=1).transpose(-1, -2) * tau
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), -math.inf)
    lse64 = torch.logsumexp(s, dim=-1)
    out = {"shape": list(shape), "causal": causal, "fixes": {}}
    for fix in fixes:
        sdpa_registry._SETTINGS = sdpa_registry._Settings(fix=fix)
        before = dict(LAUNCHES)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        handle = sdpa_registry._Handle("CPU")
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, 0.0, causal)
            res[0].backward(do)
        finally:
            handle.remove()
        registry = (res[0].detach(), *(x.grad for x in leaves))
        launched = {n: LAUNCHES[n] - before[n] for n in LAUNCHES}
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = lightning_gproj.gproj_attn_func(*ref_leaves, causal=causal, fix=fix, layout="bhsd")
        o.backward(do)
        direct = (o.detach(), *(x.grad for x in ref_leaves))
        out["fixes"][fix] = {
            "launches": launched,
            "bit_identical": {n: bool(torch.equal(a, c)) for n, a, c in zip(("o", "dq", "dk", "dv"), registry, direct)},
            "rel_vs_f64": {n: rel(a, r) for n, a, r in zip(("o", "dq", "dk", "dv"), registry, (o64, dq64, dk64, dv64))},
            "lse_max_abs_vs_f64": (res[1].double() - lse64).abs().max().item(),
            "lse_shape": list(res[1].shape),
        }
    return out


if __name__ == "__main__":
    cases = [
        run((1, 2, 1, 37, 37, 32), True, ("none", "gproj"), seed=0),
        run((1, 2, 2, 40, 45, 32), False, ("gproj",), seed=1),
    ]
    print(json.dumps({"cases": cases}))
