"""Norms of gradients that are sharded across ranks (FSDP, FSDP2 / DTensor), reduced to global values.

A rank holds part of such a gradient; the squared L2 norm of the whole is the sum over the ranks that hold
disjoint parts of their local squared norms. :func:`layout_of` says, per parameter, which part this rank
holds (:class:`Layout`) and :func:`sum_over_shards` adds local squares with one ``all_reduce`` per distinct
set of process groups. The monitors read sharded and unsharded parameters through the same two calls.

Kinds of parameter:

* A plain tensor outside any sharding FSDP unit holds the whole gradient; under DDP every rank holds the same
  one after its all-reduce. Not reduced.
* A ``DTensor`` (FSDP2 ``fully_shard``, Lightning's ``ModelParallelStrategy``, tensor parallelism): the local
  tensor is the block that ``compute_local_shape_and_global_offset`` places in the global tensor; squares are
  summed over the mesh dimensions with a ``Shard`` placement; ``Replicate`` dimensions hold the same values
  and are not summed; a ``Partial`` placement is first reduced to ``Replicate`` (one collective).
* FSDP1 (``FullyShardedDataParallel``, Lightning's ``FSDPStrategy``) with ``use_orig_params=True`` (Lightning's
  default): each original parameter is a 1-D view of the elements ``[start, end)`` of its flattened self that
  fall into this rank's shard of the unit's flat parameter (possibly none: no gradient or zero elements);
  summed over the unit's process group (the shard group under ``HYBRID_SHARD``). With
  ``use_orig_params=False`` the optimizer steps the flat parameters themselves (1-D shards, zero padding);
  their global norm is right, but the original parameters, and hence their layers, are not visible.

Every rank must call :func:`sum_over_shards` with the same groups in the same order (the monitors build the
rows from the optimizer's parameter list, which is the same on every rank, and keep a row for a sharded
parameter even where this rank holds no gradient for it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # a torch build without distributed support
    DTensor = None  # type: ignore[assignment,misc]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one parameter's local gradient sits in the full one.

    ``shape``: the full (unsharded) shape. ``groups``: process groups over whose ranks the local squares add
    up (empty: this rank holds the whole gradient, or a replica of it). ``flat_range``: FSDP1 only, the
    ``[start, end)`` range of the flattened full parameter that this rank's 1-D view holds."""

    shape: torch.Size
    groups: tuple[Any, ...] = ()
    flat_range: Optional[tuple[int, int]] = None

    @property
    def sharded(self) -> bool:
        return bool(self.groups)


#: Name components that wrappers insert between a module and its children (FSDP1, activation
#: checkpointing, a submodule compiled in place by torch.compile); :func:`clean_name` drops them so that layers keep
#: the model's own names.
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter or module path without the components of :data:`WRAPPER_COMPONENTS`
    (``blocks.0._fsdp_wrapped_module.attn.qkv.weight`` -> ``blocks.0.attn.qkv.weight``)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def fsdp1_layouts(model: torch.nn.Module) -> dict[int, Layout]:
    """``{id(param): Layout}`` for the parameters that FSDP1 units of ``model`` shard (original parameters
    with ``use_orig_params=True`` and the flat parameters themselves); empty without FSDP1. Pass the
    outermost module (``trainer.model``): Lightning's ``FSDPStrategy`` wraps the LightningModule from
    outside, so the root unit is not among the LightningModule's submodules."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return {}
    out: dict[int, Layout] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None or not handle.uses_sharded_strategy:
            continue  # NO_SHARD: whole gradients, all-reduced like DDP
        flat = handle.flat_param
        groups = (unit.process_group,)
        out[id(flat)] = Layout(flat.shape, groups, (0, flat.numel()))
        for param, shape, info in zip(flat._params or (), flat._shapes, flat._shard_param_infos):
            span = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            out[id(param)] = Layout(torch.Size(shape), groups, span)
    return out


def layout_of(param: torch.Tensor, fsdp1: dict[int, Layout]) -> Layout:
    """The :class:`Layout` of ``param`` (``fsdp1``: :func:`fsdp1_layouts` of the model)."""
    known = fsdp1.get(id(param))
    if known is not None:
        return known
    if DTensor is not None and isinstance(param, DTensor):
        mesh = param.device_mesh
        groups = tuple(mesh.get_group(i) for i, p in enumerate(param.placements) if p.is_shard())
        return Layout(param.shape, groups)
    return Layout(param.shape)


def local_part(grad: torch.Tensor, layout: Layout, part: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """This rank's elements of ``grad`` as a plain tensor, restricted to ``part`` = ``(dim, start, length)``
    of the full tensor (None: all of them). The result may be empty; its shape is unspecified beyond that."""
    if DTensor is not None and isinstance(grad, DTensor):
        placements = grad.placements
        if any(p.is_partial() for p in placements):
            placements = [Replicate() if p.is_partial() else p for p in placements]
            grad = grad.redistribute(grad.device_mesh, placements)
        local = grad.to_local()
        if part is None:
            return local
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dim, start, length = part
        shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, placements)
        lo, hi = max(start, offset[dim]), min(start + length, offset[dim] + shape[dim])
        return local.narrow(dim, lo - offset[dim], max(0, hi - lo))
    if layout.flat_range is not None:  # FSDP1: a 1-D view of the flattened elements [a, b)
        if part is None:
            return grad
        a, b = layout.flat_range
        dim, start, length = part
        inner = math.prod(layout.shape[dim + 1:])
        coord = torch.div(torch.arange(a, b, device=grad.device), inner, rounding_mode="floor") % layout.shape[dim]
        return grad.reshape(-1)[(coord >= start) & (coord < start + length)]
    return grad if part is None else grad.narrow(*part)


def squared_norm(
    grad: Optional[torch.Tensor], layout: Layout, device: torch.device, part: Optional[tuple[int, int, int]] = None
) -> torch.Tensor:
    """(local ‖·‖², present) as a float64 tensor of 2 on ``device``: the squared L2 norm of this rank's
    elements of ``grad`` (restricted to ``part``; per tensor in fp32 for 16-bit gradients) and 1, or (0, 0)
    for a missing gradient. Summed over ``layout.groups`` (:func:`sum_over_shards`) they are the global
    squared norm and the number of ranks that held a gradient."""
    if grad is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    g = grad.detach()
    if g.is_sparse:
        g = g.coalesce().values()
    local = local_part(g, layout, part)
    norm = torch.linalg.vector_norm(local, dtype=torch.promote_types(local.dtype, torch.float32))
    return torch.stack([norm.to(device, torch.float64).square(), torch.ones((), dtype=torch.float64, device=device)])


def sum_over_shards(rows: torch.Tensor, groups: Sequence[tuple[Any, ...]]) -> torch.Tensor:
    """``rows`` (n, k) with row i summed over the ranks of every group in ``groups[i]`` (rows with ``()``
    unchanged): one ``all_reduce`` per distinct group (a few; usually one), in order of first appearance.
    Collective: every rank of those groups must call it with the same ``groups``."""
    out = rows
    done: list[tuple[Any, ...]] = []
    for key in groups:
        if not key or key in done:
            continue
        done.append(key)
        index = torch.tensor([i for i, g in enumerate(groups) if g == key], device=rows.device)
        block = out.index_select(0, index)
        for group in key:
            dist.all_reduce(block, op=dist.ReduceOp.SUM, group=group)
        out = out.index_copy(0, index, block)
    return out
