"""Key biases and their gradient signals (DESIGN.md §8): which parameters are key biases, and the norms
of their gradients, global over ranks for sharded gradients.

The gradient of a key bias (a vector added to every key of a layer) is exactly Σ_j dK_j, summed over
batch and key positions, which conservation law C2 (DESIGN.md §2) makes 0 in exact arithmetic whatever
the kernel: any value is rounding error, which Adam-style optimizers turn into full-size steps of the
bias. :class:`~lightning_gproj.callbacks.ZeroSumMonitor` logs ‖∇b_k‖ and ‖∇b_k‖ / ‖∇W_k‖ from what
:func:`find_key_biases` finds (see its name heuristic below); under rotary embeddings a key bias is no
shared offset and :func:`uses_rotary` switches the signals off.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ._sharded import Layout, clean_name, layout_of, squared_norm, sum_over_shards

#: Key-bias detection, by parameter name. A module with one of these names owning a ``bias`` is a
#: key projection (HF Llama/Qwen2/OPT/BART/Whisper ``k_proj``, BERT/ViT ``key``, diffusers ``to_k``,
#: DistilBERT ``k_lin``, Meta-style ``wk``, plain ``k``); its sibling ``weight`` is the key weight.
SEPARATE_KEY_MODULES = ("k_proj", "key", "to_k", "k_lin", "wk", "k")
#: Parameters added to the keys directly (``k = k + key_bias``), as in examples/gpt.py's ``key_bias``; the
#: key weight beside them is looked up in the same module (a separate or fused projection), if any.
DIRECT_KEY_BIASES = ("key_bias", "k_bias")
#: Modules whose output is the concatenation [q | k | v] of three equal parts (GPT-2 ``c_attn``, timm and
#: others ``qkv``/``qkv_proj``/``Wqkv``); the key part is the middle third. Accepted only when the
#: weight is (3E, E) or (E, 3E) with 3E the bias length, so fused GQA projections (unequal parts) are
#: skipped rather than sliced wrong. Per-head interleaved layouts (GPT-NeoX/Falcon ``query_key_value``)
#: are deliberately not listed. ``nn.MultiheadAttention``'s ``in_proj_bias`` (same [q | k | v] layout)
#: is handled too.
FUSED_QKV_MODULES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "in_proj")


@dataclasses.dataclass(frozen=True)
class KeyBias:
    """A key bias found in the model and the key weight it is compared with.

    ``layer`` is the attention module's path (the parent of the key projection, or the
    ``nn.MultiheadAttention`` itself). ``bias_part`` = ``(start, length)`` of the key part of the bias and
    ``weight_part`` = ``(dim, start, length)`` of the key part of the weight, ``None`` meaning all of it.
    """

    layer: str
    bias_name: str
    weight_name: str
    bias: torch.nn.Parameter
    weight: torch.nn.Parameter | None
    bias_part: tuple[int, int] | None = None
    weight_part: tuple[int, int, int] | None = None

    def grad_rows(self, fsdp1: dict[int, Layout], device: torch.device) -> tuple[torch.Tensor, list[tuple]]:
        """This rank's share of ‖∇b_k‖² and ‖∇W_k‖² (key parts only): rows (square, present) of a (2, 2)
        float64 tensor, bias then weight, and the process groups of each row; sum the rows over those groups
        (:func:`~lightning_gproj.callbacks._sharded.sum_over_shards`) for the global values. Works for whole,
        DTensor and FSDP1 gradients (``fsdp1``: :func:`~lightning_gproj.callbacks._sharded.fsdp1_layouts`)."""
        bias_layout = layout_of(self.bias, fsdp1)
        bias_part = None if self.bias_part is None else (0, *self.bias_part)
        rows = [squared_norm(self.bias.grad, bias_layout, device, bias_part)]
        groups = [bias_layout.groups]
        if self.weight is None:
            rows.append(torch.zeros(2, dtype=torch.float64, device=device))
            groups.append(())
        else:
            weight_layout = layout_of(self.weight, fsdp1)
            rows.append(squared_norm(self.weight.grad, weight_layout, device, self.weight_part))
            groups.append(weight_layout.groups)
        return torch.stack(rows), groups

    def grad_norms(self, fsdp1: Optional[dict[int, Layout]] = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(‖∇b_k‖₂, ‖∇W_k‖_F) as 0-dim float64 tensors, global over ranks for sharded gradients (a
        collective then); the second is None without a key weight (or its gradient); None when the bias has
        no gradient."""
        rows, groups = self.grad_rows(fsdp1 or {}, self.bias.device)
        return _key_bias_norms(sum_over_shards(rows, groups))


def _key_bias_norms(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(bias norm, weight norm or None) from summed :meth:`KeyBias.grad_rows`, None without a bias gradient."""
    (bias_sq, bias_present), (weight_sq, weight_present) = rows.unbind(0)
    if not bias_present:
        return None
    return bias_sq.sqrt(), (weight_sq.sqrt() if weight_present else None)


def _fused_parts(weight: torch.Tensor, bias: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int, int]] | None:
    """Key parts of a [q | k | v] projection, or None if the shapes do not prove that layout."""
    n = bias.numel()
    if bias.ndim != 1 or weight.ndim != 2 or n % 3:
        return None
    e = n // 3
    # (3E, E): nn.Linear and in_proj_weight; (E, 3E): GPT-2's Conv1D. Anything else is not [q|k|v].
    if tuple(weight.shape) == (n, e):
        return (e, e), (0, e, e)
    if tuple(weight.shape) == (e, n):
        return (e, e), (1, e, e)
    return None


def uses_rotary(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a rotary position embedding (a submodule whose class name contains
    "Rotary", as in Hugging Face's ``LlamaRotaryEmbedding`` / ``Qwen2RotaryEmbedding``).

    RoPE rotates the key bias differently at every position, so it is no longer a shared key offset:
    its gradient is not Σ_j dK_j and is legitimately non-zero (a float64 check on a 1-layer Qwen2 gave
    ‖∂b_k‖/‖∂W_k‖ = 0.058, against 7e-17 for GPT-2). The key-bias signals are switched off then.
    """
    return any("rotary" in type(m).__name__.lower() for m in module.modules())


def find_key_biases(module: torch.nn.Module, shape_of: Optional[Callable[[torch.Tensor], torch.Size]] = None) -> list[KeyBias]:
    """Key biases of ``module`` by the name heuristic above (see :data:`SEPARATE_KEY_MODULES`).

    ``shape_of(param)``: the full shape of a parameter that is sharded in place (FSDP1 keeps 1-D views of
    each rank's elements; default: ``param.shape``).

    Returns at most one entry per attention layer, in ``named_parameters`` order. A parameter that
    matches a name but not the expected shapes is skipped, never guessed. A layer with both a
    projection bias and a vector added to the keys (:data:`DIRECT_KEY_BIASES`) reports the latter: both
    receive Σ_j dK_j, the direct one is what the optimizer moves as a pure key offset.
    """
    real = {clean_name(n): p for n, p in module.named_parameters()}  # FSDP1 / checkpoint wrappers dropped
    # The shape tests run on meta stand-ins of the full shapes; the results hold the real parameters.
    params = real if shape_of is None else {n: torch.empty(shape_of(p), device="meta") for n, p in real.items()}
    found: dict[str, KeyBias] = {}
    direct: dict[str, KeyBias] = {}
    for name, bias in params.items():
        owner, _, attr = name.rpartition(".")
        dot = f"{owner}." if owner else ""
        if attr in DIRECT_KEY_BIASES and bias.ndim == 1:
            weight_name, weight, part = _key_weight_of(params, dot, bias.numel())
            direct.setdefault(owner, KeyBias(owner, name, weight_name, bias, weight, None, part))
        elif attr == "in_proj_bias":  # nn.MultiheadAttention: the owner is the attention module
            if f"{dot}in_proj_weight" in params:
                weight = params[f"{dot}in_proj_weight"]
                parts = _fused_parts(weight, bias)
                if parts is not None:
                    found.setdefault(owner, KeyBias(owner, name, f"{dot}in_proj_weight", bias, weight, *parts))
            elif f"{dot}k_proj_weight" in params:  # kdim != embed_dim: separate key weight
                weight, n = params[f"{dot}k_proj_weight"], bias.numel()
                if n % 3 == 0 and weight.ndim == 2 and weight.shape[0] == n // 3:
                    kb = KeyBias(owner, name, f"{dot}k_proj_weight", bias, weight, (n // 3, n // 3))
                    found.setdefault(owner, kb)
        elif attr == "bias" and f"{dot}weight" in params:
            parent, _, proj = owner.rpartition(".")
            weight = params[f"{dot}weight"]
            if proj in SEPARATE_KEY_MODULES:
                if weight.ndim == 2 and bias.ndim == 1 and bias.numel() in weight.shape:
                    found.setdefault(parent or owner, KeyBias(parent or owner, name, f"{dot}weight", bias, weight))
            elif proj in FUSED_QKV_MODULES:
                parts = _fused_parts(weight, bias)
                if parts is not None:
                    kb = KeyBias(parent or owner, name, f"{dot}weight", bias, weight, *parts)
                    found.setdefault(parent or owner, kb)
    found.update(direct)
    order = {name: i for i, name in enumerate(params)}
    out = sorted(found.values(), key=lambda kb: order[kb.bias_name])
    if shape_of is not None:
        out = [dataclasses.replace(kb, bias=real[kb.bias_name], weight=real.get(kb.weight_name)) for kb in out]
    return out


def _key_weight_of(
    params: dict[str, torch.nn.Parameter], dot: str, n: int
) -> tuple[str, torch.nn.Parameter | None, tuple[int, int, int] | None]:
    """The key weight beside a direct key bias of length ``n`` in the module ``dot``, if one is found."""
    for proj in SEPARATE_KEY_MODULES:
        weight = params.get(f"{dot}{proj}.weight")
        if weight is not None and weight.ndim == 2 and n in weight.shape:
            return f"{dot}{proj}.weight", weight, None
    for name in [f"{dot}{proj}.weight" for proj in FUSED_QKV_MODULES] + [f"{dot}in_proj_weight"]:
        weight = params.get(name)
        if weight is not None and weight.ndim == 2:
            if tuple(weight.shape) == (3 * n, n):
                return name, weight, (0, n, n)
            if tuple(weight.shape) == (n, 3 * n):
                return name, weight, (1, n, n)
    return "", None, None


def key_bias_values(
    biases: list[KeyBias], fsdp1: dict[int, Layout], device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``{layer: (‖∇b_k‖₂, ‖∇W_k‖_F or None)}`` (0-dim float64 tensors on ``device``) of ``biases``, global
    over ranks for sharded gradients: one reduction for all of them (a collective every rank takes part
    in). Biases without a gradient are left out."""
    if not biases:
        return {}
    rows, groups = [], []
    for kb in biases:
        r, g = kb.grad_rows(fsdp1, device)
        rows.append(r)
        groups += g
    summed = sum_over_shards(torch.cat(rows), groups).reshape(len(biases), 2, 2)
    out = {}
    for kb, kb_rows in zip(biases, summed):
        norms = _key_bias_norms(kb_rows)
        if norms is not None:
            out[kb.layer] = norms
    return out
