"""Key biases (callbacks/key_bias.py): which parameters the name heuristic finds in common layouts, that
the part it reads obeys C2 in float64, and that rotary models are left out."""

from __future__ import annotations

import torch
from torch import nn

from lightning_gproj.callbacks import ZeroSumMonitor, find_key_biases
from lightning_gproj.callbacks.key_bias import uses_rotary

from _monitors import B, E, H, N


def test_find_key_biases_layouts():
    class Conv1D(nn.Module):  # GPT-2's transposed linear: weight (in, out)
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_in, n_out))
            self.bias = nn.Parameter(torch.zeros(n_out))

    m = nn.Module()
    m.gpt2 = nn.Module()
    m.gpt2.c_attn = Conv1D(E, 3 * E)
    m.llama = nn.Module()
    m.llama.q_proj, m.llama.k_proj = nn.Linear(E, E), nn.Linear(E, E // 2)
    m.mha = nn.MultiheadAttention(E, H, bias=True)
    m.gqa = nn.Module()
    m.gqa.qkv_proj = nn.Linear(E, E + 2 * (E // 2))  # fused GQA: unequal parts, must be skipped
    m.neox = nn.Module()
    m.neox.query_key_value = nn.Linear(E, 3 * E)  # per-head interleaved: not listed, skipped
    m.direct = nn.Module()
    m.direct.qkv = nn.Linear(E, 3 * E)
    m.direct.key_bias = nn.Parameter(torch.zeros(E))  # added to k: preferred over qkv.bias

    found = {kb.layer: kb for kb in find_key_biases(m)}
    assert set(found) == {"gpt2", "llama", "mha", "direct"}
    assert (found["gpt2"].bias_part, found["gpt2"].weight_part) == ((E, E), (1, E, E))
    assert (found["llama"].bias_name, found["llama"].weight_part) == ("llama.k_proj.bias", None)
    assert (found["mha"].bias_part, found["mha"].weight_part) == ((E, E), (0, E, E))
    assert (found["direct"].bias_name, found["direct"].weight_name) == ("direct.key_bias", "direct.qkv.weight")
    assert found["direct"].weight_part == (0, E, E)


def test_key_bias_slice_of_multihead_attention_obeys_c2():
    """The slice find_key_biases takes from nn.MultiheadAttention's in_proj_bias is the key part: in
    float64 its gradient vanishes (C2) while the query part's does not."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, bias=True, batch_first=True).double()
    x = torch.randn(B, N, E, dtype=torch.float64)
    out, _ = mha(x, x, x, need_weights=False)
    out.pow(2).sum().backward()
    (kb,) = find_key_biases(mha)
    bias_norm, weight_norm = kb.grad_norms()
    assert float(bias_norm / weight_norm) < 1e-12
    query_part = mha.in_proj_bias.grad[:E].norm() / mha.in_proj_weight.grad[:E].norm()
    assert float(query_part) > 1e-3


def test_key_bias_signals_off_for_rotary_models():
    """Under RoPE a key bias is rotated per position, so its gradient is not Σ_j dK_j and need not
    vanish (Qwen2): the monitor must not watch it there, but still does on the same model without RoPE."""
    class RotaryEmbedding(nn.Module):
        pass

    class Attn(nn.Module):
        def __init__(self, rotary: bool):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
            self.rotary = RotaryEmbedding() if rotary else nn.Identity()

    for rotary in (False, True):
        model = nn.Sequential(Attn(rotary))
        assert uses_rotary(model) is rotary
        assert len(find_key_biases(model)) == 1  # the name heuristic finds k_proj.bias either way
        monitor = ZeroSumMonitor(every_n_steps=1)
        monitor.on_train_start(None, model)
        assert len(monitor.key_biases) == (0 if rotary else 1)
