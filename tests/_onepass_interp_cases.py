"""Runs the one-pass backward's host side and its two small Triton kernels (kernels/attention_bwd_onepass.py: D by
_delta_kernel, the un-permute of dq's fp32 chunks by _unperm_kernel) under the CPU interpreter, the Gluon kernel's launch
replaced by a stand-in that adds a known dQ into the chunks at the offsets bulk_bases documents (see
tests/_triton_interp_cases.py for why this is a subprocess).

Executed by tests/test_onepass_backward.py with TRITON_INTERPRET=1. Output: one JSON object on the last stdout line.
Every number is measured here against float64 values computed here without the code under test.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from lightning_gproj.kernels import attention_bwd_onepass as OP  # noqa: E402


def chunk_offsets(bases, cols) -> torch.Tensor:
    """[64, cols] int64: the offset in its chunk of row r, column c of a staged partial (bit i from base i)."""
    r, c = torch.arange(64)[:, None], torch.arange(cols)[None, :]
    off = torch.zeros(64, cols, dtype=torch.int64)
    for i, (br, bc) in enumerate(bases):
        off |= (((r & br) if br else (c & bc)) != 0).long() << i
    return off


def case(b, n, h, hk, d, dtype, heads_major, seed, grad_dtype=None, causal=False):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, n, h, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hk, d, generator=gen).to(dtype) for _ in range(2))
    o = torch.randn(b, n, h, d, generator=gen).to(dtype)
    if heads_major:  # o in (batch, nheads, seqlen, headdim) memory, as Hugging Face models hand tensors over
        o = o.transpose(1, 2).contiguous().transpose(1, 2)
    m, log2l = torch.zeros(b, h, n), torch.zeros(b, h, n)
    delta = torch.empty(b, h, n)
    grad_dtype = grad_dtype or dtype
    dq = torch.empty(b, n, h, d, dtype=grad_dtype)
    x = torch.randn(b, n, h, d, generator=gen)  # the dQ the stand-in adds, fp32
    half_d = d // 2
    off = chunk_offsets(OP.bulk_bases(d), half_d)
    seen = {}

    def fake_launch(kernel, grid, device, keypad, *args):
        names = kernel.arg_names
        seen.update(grid=list(grid), n_args=len(args), n_names=len(names), keypad=keypad)
        named = dict(zip(names, args))
        acc = named["dqc_desc"].base.view(-1)
        seen.update(acc_zero=bool((acc == 0).all()), acc_numel=acc.numel(), block=list(named["dqc_desc"].block_shape),
                    H=named["H"], GROUP=named["GROUP"], N_CTX=named["N_CTX"], tau=named["tau"], c=named["c"])
        split = seen["block"][0] == d // 4  # dQ split by keys: [64, d] partials staged as bulk_bases(2·d) lays them out
        off_pair = chunk_offsets(OP.bulk_bases(2 * d), d) if split else None
        for bb in range(b):
            for row0 in range(0, n, 64):
                for hh in range(h):
                    pair = (bb * n + row0) // 64 * h + hh
                    if split:  # the pair of chunks in one box (its top column bit picks the chunk)
                        acc[pair * 64 * d + off_pair.flatten()] += x[bb, row0:row0 + 64, hh, :].flatten()
                        continue
                    for half in range(2):
                        part = x[bb, row0:row0 + 64, hh, half_d * half:half_d * (half + 1)]
                        acc[(pair * 2 + half) * 64 * half_d + off.flatten()] += part.flatten()
        named["DK"].fill_(1.0)
        named["DV"].fill_(2.0)

    OP.launch, real = fake_launch, OP.launch
    # torch.empty's memory NaN-filled (PyTorch's deterministic mode fills it), so that acc_zero holds only where the D
    # kernel zeroed the chunk buffer
    torch.use_deterministic_algorithms(True)
    try:
        dk, dv = OP.backward(q, k, v, do, o, m, log2l, delta, dq, 1.25 * 1.4426950408889634, 1.25, causal, grad_dtype,
                             grad_dtype)
    finally:
        OP.launch = real
        torch.use_deterministic_algorithms(False)
    d64 = (o.double() * do.double()).sum(-1).transpose(1, 2)  # (b, h, n)
    want = x.double() * 1.25
    return {
        **seen,
        "delta_rel": ((delta.double() - d64).norm() / d64.norm()).item(),
        # the largest error in ulps of τ x (subnormals: of the smallest normal); the interpreter's bf16 casts truncate
        "dq_ulps": ((dq.double() - want).abs() / (want.abs().clamp(min=torch.finfo(grad_dtype).tiny)
                                                  * torch.finfo(grad_dtype).eps)).max().item(),
        "dk_dv": [dk.shape == k.shape, dv.shape == v.shape, dk.dtype == dv.dtype == grad_dtype, bool((dk == 1).all()),
                  bool((dv == 2).all())],
        "offsets_bijective": sorted(off.flatten().tolist()) == list(range(64 * half_d)),
    }


out = {"bshd": case(2, 256, 4, 2, 128, torch.bfloat16, False, 0),
       "bhsd_fp16": case(1, 384, 2, 1, 128, torch.float16, True, 1),
       "fp32_grads": case(1, 128, 2, 2, 128, torch.bfloat16, False, 2, torch.float32),
       "d64": case(2, 256, 4, 2, 64, torch.bfloat16, False, 3),
       "d64_causal": case(2, 256, 4, 4, 64, torch.bfloat16, False, 4, causal=True)}  # dQ partials split by keys
print(json.dumps(out))
