"""torch.compile sees every swap target's attention as the op, with no graph break.

``torch._dynamo.explain`` traces the swapped model: one graph, zero breaks, and the op
(``lightning_gproj::attn_fwd``) in it once per attention layer. A ``fullgraph=True`` compile
(``aot_eager`` backend: the traced forward and backward graphs, no code generation, to keep CPU CI
fast) then matches the uncompiled original. Tolerance fp32 2e-5 of the max-abs value: as in
test_swap.py, only the attention's summation order and the GProj correction of an fp32 rounding
residual (~1e-7 relative) differ.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch._dynamo
import transformers
from torch import nn

import test_swap_flash_attn as flash_tests
from _attention_models import Block, SDPAAttention, TinyModel, rel_err
from lightning_gproj.swap import swap_attention


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _op_calls(explanation) -> int:
    return sum(gm.code.count("lightning_gproj.attn_fwd") for gm in explanation.graphs)


def _assert_one_graph_with_ops(model, n_ops, *args, **kwargs):
    explanation = torch._dynamo.explain(model)(*args, **kwargs)
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    assert explanation.graph_count == 1
    assert _op_calls(explanation) == n_ops


def test_compiled_sdpa_gpt_has_no_graph_break_and_matches():
    torch.manual_seed(0)
    gpt = nn.Sequential(
        Block(SDPAAttention(32, 4, is_causal=True)),
        Block(SDPAAttention(32, 4, kv_heads=2, enable_gqa=True, is_causal=True)),
    )
    swapped = copy.deepcopy(gpt)
    assert len(swap_attention(swapped).swapped) == 2
    x = torch.randn(2, 8, 32)
    _assert_one_graph_with_ops(swapped, 2, x)

    compiled = torch.compile(swapped, fullgraph=True, backend="aot_eager")
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out, ref = compiled(xs[0]), gpt(xs[1])
    assert rel_err(out, ref) <= 2e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    assert rel_err(xs[0].grad, xs[1].grad) <= 2e-5
    for (name, p), q in zip(swapped.named_parameters(), gpt.parameters()):
        assert rel_err(p.grad, q.grad) <= 2e-5, name


def test_compiled_multihead_attention_model_has_no_graph_break():
    torch.manual_seed(0)
    model = TinyModel()  # an SDPA block and an nn.MultiheadAttention block
    swap_attention(model)
    _assert_one_graph_with_ops(model, 2, torch.randint(0, 11, (2, 5)))


def test_compiled_hf_llama_has_no_graph_break():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    swap_attention(model)
    _assert_one_graph_with_ops(model, 2, input_ids=torch.randint(0, 50, (2, 9)))


def test_compiled_flash_attn_call_site_has_no_graph_break(monkeypatch):
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_func = flash_tests._fa2
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    mod = types.ModuleType("_fake_flash_model_compiled")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(flash_tests.MODEL_SOURCE.format(source="flash_attn", alias="flash_attn_func", take=""), mod.__dict__)
    torch.manual_seed(0)
    model = nn.Sequential(mod.Block(causal=True), mod.Block(causal=True))
    swap_attention(model)
    _assert_one_graph_with_ops(model, 2, torch.randn(2, 5, 32))
