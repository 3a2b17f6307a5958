"""Values behind a key mask never reach a result or a gradient, on every path.

The rule (gproj_attn_func's docstring): keys j >= seqlens_k[b] are never read into o, dq, dk, dv or the
recorded statistics, and get dk = dv = 0 exactly. Each check runs the same call twice, once with the
padded keys and values clean and once with NaN, +inf, -inf or 1e10 there, and asserts bit-identical
results: the CPU reference through the op (the path CPU users run), the fp32-attention path of a
swapped module (``Site.compute_dtype``), and the swap targets that turn a padding mask into
``seqlens_k`` (SDPA with a boolean key-padding mask, ``nn.MultiheadAttention`` with
``key_padding_mask``, a Hugging Face Llama with a right-padded ``attention_mask``). The Triton kernels
are checked the same way under the interpreter (test_triton_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from lightning_gproj import RECORDER, gproj_attn_func, swap_attention

POISONS = [float("nan"), float("inf"), float("-inf"), 1e10]


def _poisoned(x: torch.Tensor, hidden: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` (batch, seqlen, ...) with the positions ``hidden`` (batch, seqlen) set to ``value``."""
    x = x.detach().clone()
    x[hidden] = value
    return x


def _run_op(q, k, v, do, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    RECORDER.drain()
    with RECORDER.recording():
        o = gproj_attn_func(q, k, v, stats_name="layer", **kwargs)
        o.backward(do)
    return (o.detach(), q.grad, k.grad, v.grad), RECORDER.drain()["layer"]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fix", ["none", "gproj", "gproj_uniform"])
@pytest.mark.parametrize(
    "shape, causal, lengths",
    [
        ((1, 2, 1, 1, 8), False, [1]),  # the example: B=1, N=2, H=1, d=8, seqlens_k=[1]
        ((2, 12, 4, 2, 16), True, [5, 12]),  # GQA 2:1, causal + padding
    ],
)
def test_op_ignores_values_behind_key_padding(shape, causal, lengths, fix, dtype, poison, recorder_off):
    b, n, h, hk, d = shape
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(b, n, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hk, d, generator=g).to(dtype) for _ in range(2))
    seqlens_k = torch.tensor(lengths)
    hidden = torch.arange(n)[None, :] >= seqlens_k[:, None]
    kwargs = dict(causal=causal, fix=fix, seqlens_k=seqlens_k)
    clean, clean_stats = _run_op(q, k, v, do, **kwargs)
    dirty, dirty_stats = _run_op(q, _poisoned(k, hidden, poison), _poisoned(v, hidden, -poison), do, **kwargs)
    for name, x, y in zip(("o", "dq", "dk", "dv"), clean, dirty):
        assert torch.equal(x, y), name
    assert (dirty[2][hidden] == 0).all() and (dirty[3][hidden] == 0).all()
    assert clean_stats.keys() == dirty_stats.keys() and "mean_key_norm" in dirty_stats
    for stat, value in clean_stats.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(dirty_stats[stat])) or (
            torch.isnan(torch.as_tensor(value)) and torch.isnan(torch.as_tensor(dirty_stats[stat]))
        ), stat


class KeyPaddingSDPA(nn.Module):
    """Calls SDPA with a boolean (batch, 1, 1, Nk) key-padding mask (True = attend)."""

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return [out.detach()] + [x.grad for x in inputs]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("attention_dtype", [None, torch.float32])
def test_swapped_sdpa_ignores_values_behind_key_padding(poison, attention_dtype):
    """A right key-padding mask is served with seqlens_k, by the op or (fp32 remediation) by fp32 SDPA
    on zeroed padded keys; in (batch, heads, seqlen, dim) layout."""
    module = KeyPaddingSDPA()
    report = swap_attention(module)
    report.sites[""].compute_dtype = attention_dtype
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g).bfloat16() for _ in range(3))
    lengths = torch.tensor([5, 8])
    mask = (torch.arange(8)[None, :] < lengths[:, None])[:, None, None, :]
    hidden = (~mask[:, 0, 0, :])[:, None, :].expand(2, 2, 8)  # (batch, heads, Nk)
    clean = _grads(lambda q, k, v: module(q, k, v, mask), q, k, v)
    dirty = _grads(lambda q, k, v: module(q, k, v, mask), q, _poisoned(k, hidden, poison), _poisoned(v, hidden, poison))
    assert report.sites[""].served == 2 and not report.sites[""].fallbacks
    for name, x, y in zip(("o", "dq", "dk", "dv"), clean, dirty):
        assert torch.equal(x, y), name
    assert (dirty[2][hidden] == 0).all() and (dirty[3][hidden] == 0).all()


@pytest.mark.parametrize("poison", POISONS)
def test_swapped_multihead_attention_ignores_padded_keys(poison):
    """Cross-attention with a right-padding key_padding_mask: the padded key/value inputs are poisoned;
    the output and the query / key / value input gradients are those of the clean call (the padded
    inputs' own gradients 0). The in-projection's weight gradient is left out: it multiplies the
    padded inputs by their (zero) gradient outside the attention, as in the original module."""
    torch.manual_seed(5)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    report = swap_attention(mha)
    query = torch.randn(2, 6, 32)
    memory = torch.randn(2, 9, 32)
    kpm = torch.arange(9)[None, :] >= torch.tensor([4, 9])[:, None]  # True = ignore (right padding)
    run = lambda qu, ke, va: mha(qu, ke, va, key_padding_mask=kpm, need_weights=False)[0]  # noqa: E731
    clean = _grads(run, query, memory, memory)
    dirty = _grads(run, query, _poisoned(memory, kpm, poison), _poisoned(memory, kpm, poison))
    assert report.sites[""].served == 2 and not report.sites[""].fallbacks
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    for x, y in zip(clean[2:], dirty[2:]):
        assert torch.equal(x[~kpm], y[~kpm]) and (y[kpm] == 0).all()


@pytest.mark.parametrize("poison", POISONS)
def test_swapped_llama_ignores_right_padded_tokens(poison):
    """A right-padded attention_mask (served as causal + seqlens_k): poisoned embeddings of the padded
    tokens leave the logits of the valid tokens bit-identical to the clean call."""
    torch.manual_seed(6)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    report = swap_attention(model)
    embeds = torch.randn(2, 9, 32)
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[0, 5:] = 0
    hidden = attention_mask == 0
    with torch.no_grad():
        clean = model(inputs_embeds=embeds, attention_mask=attention_mask).logits
        dirty = model(inputs_embeds=_poisoned(embeds, hidden, poison), attention_mask=attention_mask).logits
    assert all(site.served == 2 and not site.fallbacks for site in report.sites.values())
    assert torch.equal(clean[~hidden], dirty[~hidden])
