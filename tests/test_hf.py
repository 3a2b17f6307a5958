"""Hugging Face ``transformers`` models through the attention registry ("gproj").

Tiny models built from a config with random weights (no download): Llama (GQA), Qwen2 (GQA, biased
q/k/v), GPT-NeoX (partial rotary, fused qkv) and ViT (bidirectional, through SDPA).

Tolerances. fp32: the swapped model computes the same attention as ``sdpa_attention_forward`` in fp32
with another summation order; the GProj correction of fp32 inputs removes only the fp32 rounding
residual of each dS row (~1e-7 relative). With O(1) activations, headdim 8 and <= 9 keys per row
these are a few ulp per attention; through two layers (norms, MLPs, the LM head) outputs and all
parameter gradients agree to 2e-5 of their max-abs value. Fallbacks run ``sdpa_attention_forward``
itself with the same arguments, so their results are compared bitwise.
"""

from __future__ import annotations

import copy
import logging
import warnings

import lightning as L
import numpy as np
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _attention_models import OpSpy, logits_and_grads, op_spy, rel_err  # noqa: F401 (fixture)
from lightning_gproj.plugin import GProjPlugin
from lightning_gproj.swap import GProjFallbackWarning, swap_attention, unswap_attention

TOL = 2e-5
VOCAB = 50


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64))


def _neox():
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_labels=3))


# name: (builder, attention module class name, k/v heads, causal)
MODELS = {
    "llama": (_llama, "LlamaAttention", 2, True),
    "qwen2": (_qwen2, "Qwen2Attention", 1, True),
    "gpt_neox": (_neox, "GPTNeoXAttention", 4, True),
    "vit": (_vit, "ViTAttention", 4, False),
}


def _inputs(name, batch=2):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return dict(pixel_values=torch.randn(batch, 3, 8, 8, generator=g))
    return dict(input_ids=torch.randint(0, VOCAB, (batch, 9), generator=g))


def _build(name):
    torch.manual_seed(0)
    model = MODELS[name][0]().train()  # dropout probabilities are 0 in these configs
    assert model.config._attn_implementation == "sdpa"
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_model_matches_original(name, op_spy):
    _, cls, kv_heads, causal = MODELS[name]
    model, swapped = _build(name)
    keys = list(model.state_dict())
    report = swap_attention(swapped)
    assert swapped.config._attn_implementation == "gproj"
    paths = [r.module_path for r in report.swapped]
    assert len(paths) == 2 and all(r.original == f"{cls}: transformers attention ('sdpa')" for r in report.swapped)
    assert "via AttentionInterface 'gproj'" in report.table()
    assert list(swapped.state_dict()) == keys
    inputs = _inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = logits_and_grads(swapped, **inputs)
    out_ref, grads_ref = logits_and_grads(model, **inputs)
    assert rel_err(out, out_ref) <= TOL
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    for key in grads_ref:
        if name == "vit" and key.endswith("k_proj.bias"):
            # without rotary embeddings a key bias adds q·b to every score of a row, which softmax
            # ignores: its gradient is 0 in exact arithmetic (the zero-sum law); both hold rounding noise
            scale = grads_ref[key.replace("bias", "weight")].abs().max()
            assert grads[key].abs().max() <= 1e-6 * scale and grads_ref[key].abs().max() <= 1e-6 * scale, key
            continue
        assert rel_err(grads[key], grads_ref[key]) <= TOL, key
    assert [(c["stats_name"], c["causal"], c["k_shape"][2], c["softmax_scale"]) for c in op_spy.calls] == [
        (p, causal, kv_heads, 8**-0.5) for p in paths]
    n = 5 if name == "vit" else 9
    assert all(c["q_shape"] == (2, n, 4, 8) for c in op_spy.calls)

    assert unswap_attention(swapped) == 2 and swapped.config._attn_implementation == "sdpa"
    assert torch.equal(swapped(**inputs).logits, model(**inputs).logits)


def test_all_true_padding_mask_is_served_and_padding_falls_back(op_spy):
    model, swapped = _build("llama")
    swap_attention(swapped)
    ids = _inputs("llama")["input_ids"]
    full = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        assert rel_err(swapped(ids, attention_mask=full).logits, model(ids, attention_mask=full).logits) <= TOL
    assert len(op_spy.calls) == 2 and all(c["causal"] for c in op_spy.calls)

    padded = full.clone()
    padded[0, 3] = 0  # a hole: neither right nor left padding
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(swapped(ids, attention_mask=padded).logits, model(ids, attention_mask=padded).logits)
    messages = [str(w.message) for w in record if issubclass(w.category, GProjFallbackWarning)]
    assert len(messages) == 2, messages  # one per layer, not per call
    assert "model.layers.0.self_attn (LlamaAttention)" in messages[0] and "padding" in messages[0]
    assert len(op_spy.calls) == 2


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_left_padding_is_served_as_packed_sequences(name, op_spy, monkeypatch):
    """A left-padded attention_mask (rows 0 and 1 with 3 and 1 padding tokens): causal & left padding,
    checked value by value, is served as packed sequences through the varlen op (flash-attention's
    unpadding) with zeros at the padding tokens, as SDPA gives rows that see no key. Logits on the real
    tokens and every parameter gradient (cotangent 0 on padding tokens) match the original model."""
    import lightning_gproj.ops as ops

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    model, swapped = _build(name)
    swap_attention(swapped)
    ids = _inputs(name)["input_ids"]
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    padded[1, :1] = 0
    real = padded.bool()

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = logits_and_grads(swapped, real, input_ids=ids, attention_mask=padded)
    out_ref, grads_ref = logits_and_grads(model, real, input_ids=ids, attention_mask=padded)
    assert rel_err(out[real], out_ref[real]) <= TOL
    for key in grads_ref:
        assert rel_err(grads[key], grads_ref[key]) <= TOL, key
    n = ids.shape[1]
    assert len(varlen_spy.calls) == 2 and not op_spy.calls
    for c in varlen_spy.calls:
        assert c["causal"] and c["cu_seqlens_q"].tolist() == [0, n - 3, 2 * n - 4] == c["cu_seqlens_k"].tolist()


def test_left_padded_prompt_of_generate_is_served_and_decodes_as_the_original(op_spy):
    """model.generate on one left-padded prompt passes position_ids [0, 0, 0, 0, 1, 2, ...], which look like
    packed sequences; the mask (causal & left padding) decides, so the prefill is served as packed
    sequences, and the greedy tokens equal the original model's."""
    model, swapped = _build("llama")
    model.eval(), swapped.eval()
    report = swap_attention(swapped)
    ids = _inputs("llama", batch=1)["input_ids"]
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got = swapped.generate(ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)
    site = report.sites["model.layers.0.self_attn"]
    assert site.served >= 1 and not any("packed" in reason for reason in site.fallbacks)
    # the decode steps (one query, cached keys, left padding) fall back, and their reason says so
    assert site.served == 1 and sum(site.fallbacks.values()) == 3
    assert all("a cached call with left padding" in reason for reason in site.fallbacks), site.fallbacks


def test_attention_sinks_fall_back_to_the_models_eager_attention():
    """gpt-oss passes its attention sinks as ``s_aux``: GProj does not serve them, and the fallback is the
    model's own eager attention (SDPA would drop the sinks); the logits equal the original's."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0, 2.0)  # sinks that matter
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    ids = _inputs("llama")["input_ids"]
    with pytest.warns(GProjFallbackWarning, match="s_aux is set"):
        out = swapped(ids).logits
    assert rel_err(out, model(ids).logits) <= 1e-6


@pytest.mark.parametrize("case", ["window", "packed", "window_left_padded"])
def test_head_dim_the_op_does_not_take_falls_back_on_every_path(case, op_spy):
    """Head dim 12 (not a multiple of 8): the sliding-window and packed paths fall back with the warning as the plain
    one does, and the logits equal the original's (they reached the op, which raised; new-user pass 12)."""
    torch.manual_seed(0)
    if case == "packed":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            sliding_window=4)
        model = transformers.MistralForCausalLM(config)
    model.eval()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    ids = torch.randint(0, VOCAB, (2, 8))
    kwargs = {}
    if case == "packed":  # two sequences of 3 and 5 tokens in one row
        ids, kwargs = ids[:1], dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    elif case == "window_left_padded":
        kwargs = dict(attention_mask=torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5]))
    with pytest.warns(GProjFallbackWarning, match="headdim 12"):
        out = swapped(ids, **kwargs).logits
    assert torch.equal(out, model(ids, **kwargs).logits)  # the original attention, with the same arguments
    assert op_spy.calls == []


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_output_attentions_runs_the_models_eager_attention(implementation, op_spy):
    """output_attentions=True: the op computes no weights, so each swapped layer runs the model's eager attention
    with one warning, and the weights are the eager model's (they came back empty, silently; new-user pass 12). From
    an SDPA model too: transformers' own SDPA path returns none."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(_llama().config, attn_implementation="eager").eval()
    reference = copy.deepcopy(model)
    model.set_attn_implementation(implementation)
    swap_attention(model)
    ids = _inputs("llama")["input_ids"]
    with pytest.warns(GProjFallbackWarning, match=r"output_attentions=True \(the op computes no attention weights\)"):
        got = model(ids, output_attentions=True).attentions
    want = reference(ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert op_spy.calls == []
    model(ids)  # without weights asked for, served again
    assert len(op_spy.calls) == 2


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_right_padding_mask_is_served_with_seqlens_k(name, op_spy):
    """A right-padded attention_mask: transformers' sdpa_mask builds causal & padding as a boolean
    (batch, 1, Nq, Nk) mask; its values are checked and the call served with seqlens_k. Every query
    row (padded ones included) still sees key 0, so the original's output is defined everywhere and
    the whole logits and all gradients are compared."""
    model, swapped = _build(name)
    swap_attention(swapped)
    ids = _inputs(name)["input_ids"]
    padded = torch.ones_like(ids)
    padded[0, 6:] = 0  # right padding: batch row 0 has 6 valid tokens
    inputs = dict(input_ids=ids, attention_mask=padded)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = logits_and_grads(swapped, **inputs)
    out_ref, grads_ref = logits_and_grads(model, **inputs)
    assert rel_err(out, out_ref) <= TOL
    assert grads.keys() == grads_ref.keys()
    for key in grads_ref:
        assert rel_err(grads[key], grads_ref[key]) <= TOL, key
    assert len(op_spy.calls) == 2
    assert all(c["causal"] and c["seqlens_k"].tolist() == [6, 9] for c in op_spy.calls)


def test_training_dropout_is_served(op_spy):
    """attention_dropout > 0: every training call runs the op with dropout_p = the model's dropout (no
    fallback), reproducibly after the same torch.manual_seed; eval calls (HF passes dropout=0.0) are
    served without dropout and match the original model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        attention_dropout=0.3)
    model = transformers.LlamaForCausalLM(config).train()
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert "attention dropout and right or left padding are served" in report.rows[0].reason
    ids = _inputs("llama")["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        torch.manual_seed(3)
        out = swapped(ids).logits
        torch.manual_seed(3)
        assert torch.equal(out, swapped(ids).logits)
        assert [c["dropout_p"] for c in op_spy.calls] == [0.3, 0.3]
        swapped.eval()
        assert rel_err(swapped(ids).logits, model.eval()(ids).logits) <= TOL and "dropout_p" not in op_spy.calls[2]
    assert rel_err(out, model(ids).logits) >= 1e-2  # the training call did drop


def test_gpt2_default_attn_pdrop_is_served():
    """GPT-2's default attn_pdrop=0.1 no longer makes its attention fall back in training."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    assert config.attn_pdrop == 0.1  # the default
    model = transformers.GPT2LMHeadModel(config).train()
    report = swap_attention(model)
    assert [r.module_path for r in report.swapped] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        model(_inputs("llama")["input_ids"]).logits.sum().backward()
    assert [report.sites[p].served for p in ("transformer.h.0.attn", "transformer.h.1.attn")] == [1, 1]


def test_fabric_plugin_swaps_a_transformers_model(op_spy):
    from lightning_gproj.fabric import GProjFabricPlugin

    plugin = GProjFabricPlugin("32-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, plain = _build("llama")
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = _inputs("llama")["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    expected = float(plain(input_ids=ids, labels=ids).loss.detach())
    assert abs(float(loss.detach()) - expected) <= 1e-5 * expected
    fabric.backward(loss)
    optimizer.step()
    assert len(plugin.report.swapped) == 2 and len(op_spy.calls) == 2


def test_include_exclude_and_idempotence(op_spy):
    model, swapped = _build("llama")
    report = swap_attention(swapped, exclude="model.layers.1*")
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [
        ("model.layers.0.self_attn", True), ("model.layers.1.self_attn", False)]
    assert "excluded by pattern 'model.layers.1*'" in report.rows[1].reason
    report = swap_attention(swapped, exclude="model.layers.1*", fix="none")
    assert report.rows[0].reason.startswith("already swapped")
    ids = _inputs("llama")["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        assert rel_err(swapped(ids).logits, model(ids).logits) <= TOL
    assert [(c["stats_name"], c["fix"]) for c in op_spy.calls] == [("model.layers.0.self_attn", "none")]
    model.load_state_dict(swapped.state_dict(), strict=True)


def test_eager_model_is_switched_and_restored(op_spy):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert report.rows[0].original == "LlamaAttention: transformers attention ('eager')"
    assert "its masks are now built as for 'sdpa', not 'eager'" in report.rows[0].reason
    ids = _inputs("llama")["input_ids"]
    assert rel_err(swapped(ids).logits, model(ids).logits) <= TOL and len(op_spy.calls) == 2
    unswap_attention(swapped)
    assert swapped.config._attn_implementation == "eager"
    assert torch.equal(swapped(ids).logits, model(ids).logits)


def test_eager_model_runs_eager_where_gproj_does_not_serve(op_spy):
    """An eager model's layer left unswapped, and a swapped layer's fallback, run the model's eager attention — what
    it ran before, bit for bit — not SDPA (the swap report says "left alone"; new-user pass 12)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    ids = _inputs("llama")["input_ids"]
    swapped = copy.deepcopy(model)
    swap_attention(swapped, include="model.layers.0*", fix="none")
    mask = torch.ones_like(ids)
    mask[0, 3] = 0  # a hole: every layer falls back (layer 0 with a warning)
    with pytest.warns(GProjFallbackWarning, match="model.layers.0.self_attn"):
        got = swapped(ids, attention_mask=mask).logits
    assert torch.equal(got, model(ids, attention_mask=mask).logits) and op_spy.calls == []
    swapped(ids)  # served in layer 0, left alone (eager) in layer 1
    assert [c["stats_name"] for c in op_spy.calls] == ["model.layers.0.self_attn"]
    assert "_gproj_hf_impl" in vars(swapped.model.layers[1].self_attn)
    unswap_attention(swapped)
    assert not any("_gproj_hf_impl" in vars(m) for m in swapped.modules())


class LitLlama(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = _llama()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (12, 9), generator=g)), batch_size=4)


def _fit(tmp_path, **kwargs):
    return _fit_module(LitLlama(), tmp_path, **kwargs)


def _fit_module(module, tmp_path, **kwargs):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kwargs)
    trainer.fit(module)
    return module


@pytest.mark.parametrize("precision, tol, autocast", [("32-true", 1e-5, False), ("bf16-mixed", 2e-2, True)])
def test_trainer_fit_with_plugin_matches_plain_run(precision, tol, autocast, op_spy, tmp_path):
    # 3 SGD steps. 32-true: the few-ulp attention differences reach the loss at < 1e-5 relative;
    # bf16-mixed: both runs round to bf16 (4e-3 per rounding) at different points: 2e-2. Under
    # autocast Llama's q, k leave the rotary embedding in fp32 while v is bf16: SDPA and the op both
    # cast all three to bf16, so the call is served.
    plain = _fit(tmp_path, precision=precision)
    plugin = GProjPlugin(precision)
    swapped = _fit(tmp_path, plugins=[plugin])
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= tol * abs(b)
    assert len(op_spy.calls) == 6 and swapped.model.config._attn_implementation == "gproj"
    expected = (torch.float32, torch.float32, torch.bfloat16) if autocast else (torch.float32,) * 3
    assert all(c["autocast"] is autocast and c["dtypes"] == expected for c in op_spy.calls)
    assert [r.module_path for r in plugin.report.swapped] == ["model.model.layers.0.self_attn", "model.model.layers.1.self_attn"]


class LitGPT2(LitLlama):
    """GPT-2 trained on batches with a padding hole: every training call of its attention falls back."""

    def __init__(self):
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))
        self.losses = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        mask = torch.ones_like(ids)
        mask[:, 2] = 0  # a hole in every row: neither right nor left padding
        loss = self.model(input_ids=ids, attention_mask=mask, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss


def test_gpt2_with_a_padding_hole_is_reported_as_never_served(tmp_path, op_spy):
    """"2 swapped", yet every training call falls back (a hole in the padding mask). The swap table's
    notes fit in 100 columns and carry no catch_all footer; the first optimizer step warns; the calls
    summary after fit says the run used the original attention."""
    plugin = GProjPlugin("32-true")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.extend(record.getMessage().splitlines())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        with pytest.warns(GProjFallbackWarning, match=r"2 of 2 swapped attention modules served none of their calls"):
            _fit_module(LitGPT2(), tmp_path, plugins=[plugin])
    finally:
        logger.removeHandler(handler)
    table = plugin.report.table().splitlines()
    assert table[0] == "GProj attention swap (fix='gproj'): 2 swapped, 0 left alone"
    notes = [line for line in table[3:] if line.startswith("    ")]
    assert notes and all(len(line) <= 100 for line in notes)
    note = " ".join(line.strip() for line in notes[: len(notes) // 2])
    assert note == plugin.report.rows[0].reason
    assert not any("catch_all" in line for line in table)
    assert "GProj attention calls (fix='gproj'): 2 swapped modules, 2 served no call (the run used their original attention)" in lines
    assert "model.transformer.h.0.attn | 0      | 3" in lines
    assert op_spy.calls == []


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_packed_sequences_are_served_through_the_varlen_op(name, source, op_spy, monkeypatch):
    """Sequences of 4, 1 and 6 tokens packed into one row (position_ids restarting at 0, as
    DataCollatorWithFlattening builds them; with the cache on, no mask is built; with its cu_seq_lens /
    max_length kwargs and use_cache=False, the block-diagonal mask arrives and is checked): every
    attention call is served by gproj_attn_varlen_func (no fallback), and in float64 the logits
    and every parameter gradient equal those of the original model run on each sequence alone (the
    gradients summed over the sequences) to 1e-10 relative."""
    import lightning_gproj.ops as ops

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    model, swapped = _build(name)
    model, swapped = model.double(), swapped.double()
    swap_attention(swapped)
    lens = [4, 1, 6]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    weight = torch.cos(torch.arange(sum(lens) * VOCAB, dtype=torch.float64)).view(1, sum(lens), VOCAB)
    kwargs = dict(input_ids=ids, position_ids=position_ids)
    if source == "cu_seq_lens":
        cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        packed = swapped(**kwargs).logits
    (packed * weight).sum().backward()

    start, alone = 0, []
    for n in lens:  # the original model, one sequence at a time
        logits = model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None]).logits
        (logits * weight[:, start:start + n]).sum().backward()
        alone.append(logits.detach())
        start += n
    assert rel_err(packed.detach(), torch.cat(alone, dim=1)) <= 1e-10
    for (pname, p), (_, p_ref) in zip(swapped.named_parameters(), model.named_parameters()):
        assert rel_err(p.grad, p_ref.grad) <= 1e-10, pname
    assert op_spy.calls == [] and len(varlen_spy.calls) == 2  # two layers, both packed
    assert all(c["cu_seqlens_q"].tolist() == [0, 4, 5, 11] and c["causal"] and c["max_seqlen_q"] == 6
               for c in varlen_spy.calls)


def test_packed_mask_that_is_not_block_diagonal_falls_back(op_spy, monkeypatch):
    """cu_seq_lens kwargs that disagree with the mask built from position_ids (no cache): not served
    (warns), the result is sdpa_attention_forward's."""
    model, swapped = _build("llama")
    swap_attention(swapped)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(4), torch.arange(6)])[None]
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    kwargs = dict(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5,
                  max_length_k=5, use_cache=False)
    with pytest.warns(GProjFallbackWarning, match="not their block-diagonal mask"):
        out = swapped(**kwargs).logits
    assert torch.equal(out, model(**kwargs).logits) and op_spy.calls == []


@pytest.mark.parametrize("kwargs, served", [
    (dict(softcap=float("inf")), False), (dict(softcap=float("nan")), False), (dict(softcap=True), False),
    (dict(softcap=-1.0), False), (dict(softcap=np.float32(2.0)), True), (dict(softcap=torch.tensor(2.0)), True),
    (dict(sliding_window=np.int64(4)), True), (dict(sliding_window=True), False), (dict(sliding_window=2.0), False),
])
def test_softcap_and_window_values_are_checked_as_the_op_checks_them(kwargs, served):
    """The values a model hands the attention function are served where the op takes them and fall back (with a
    reason naming them) where it would raise — an inf softcap reached the op and raised inside the forward, a NumPy
    one fell back with a false reason (review of session 27)."""
    from lightning_gproj.swap import hf

    module = nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    reason, call = hf.plan(module, q, k, k, None, 0.0, 0.25, None, kwargs)
    assert (reason is None) == served, reason
    if not served:
        assert reason.startswith(next(iter(kwargs)) + "="), reason
    else:
        assert call[7] == pytest.approx(float(kwargs.get("softcap", 0.0)))
        assert call[6] == ((int(kwargs["sliding_window"]) - 1, 0) if "sliding_window" in kwargs else (-1, -1))
