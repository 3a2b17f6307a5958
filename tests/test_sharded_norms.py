"""Gradient norms of sharded parameters, reduced over ranks (callbacks/_sharded.py), on two gloo processes.

Each rank builds the same small model (a fused [q | k | v] projection with a key bias on top, a GPT-2
Conv1D-style ``c_attn`` whose key part is a column block, odd sizes so that shards are uneven), shards it
with FSDP2 ``fully_shard`` or FSDP1 ``FullyShardedDataParallel`` (``device_id=cpu``), runs forward and
backward on its half of a batch, and measures with ``GradNormMonitor.measure`` and ``ZeroSumMonitor``'s
key-bias signals. The reference is computed on the same rank, independently of the code under test: an
unsharded float64 copy of the model on the whole batch, norms by ``torch.linalg.vector_norm`` on full
gradients. The sharded models run in float64 too, so the comparison is to float64 rounding.
"""

from __future__ import annotations

import json
import math
import os
import socket
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor
from lightning_gproj.callbacks.grad_norm import default_layer_of

E, V, BATCH, SEQ = 6, 13, 4, 5  # E: width (3E = 18 rows of qkv), V: vocab; odd sizes give uneven shards


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)  # key part: rows [E, 2E) of the weight, [E, 2E) of the bias
        self.key_bias = nn.Parameter(torch.zeros(E))  # the direct key bias the monitor reports

    def forward(self, x):
        q, k, v = self.qkv(x).split(E, dim=-1)
        k = k + self.key_bias
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), dim=-1)
        return x + p @ v


class Conv1DAttn(nn.Module):
    """GPT-2 layout: ``c_attn.weight`` is (E, 3E), so its key part is the column block [E, 2E)."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Module()
        self.c_attn.weight = nn.Parameter(torch.randn(E, 3 * E) * 0.3)
        self.c_attn.bias = nn.Parameter(torch.randn(3 * E) * 0.1)

    def forward(self, x):
        q, k, v = (x @ self.c_attn.weight + self.c_attn.bias).split(E, dim=-1)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), dim=-1)
        return x + p @ v


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.blocks = nn.ModuleList([Attn(), Conv1DAttn()])
        self.head = nn.Linear(E, V)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))


def _reference(idx) -> dict:
    """Norms of the full float64 gradients of the whole batch, by plain torch on an unsharded model."""
    torch.manual_seed(0)
    model = Net().double()
    _loss(model, idx).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    layers: dict[str, float] = {}
    for name, g in grads.items():
        layers[default_layer_of(name)] = layers.get(default_layer_of(name), 0.0) + float(g.pow(2).sum())
    key = {
        "blocks.0": (grads["blocks.0.key_bias"], grads["blocks.0.qkv.weight"][E:2 * E]),
        "blocks.1": (grads["blocks.1.c_attn.bias"][E:2 * E], grads["blocks.1.c_attn.weight"][:, E:2 * E]),
    }
    return {
        "global": math.sqrt(sum(layers.values())),
        "layers": {k: math.sqrt(v) for k, v in layers.items()},
        "key_bias_grad_norm": {k: float(b.norm()) for k, (b, w) in key.items()},
        "key_bias_grad_ratio": {k: float(b.norm() / w.norm()) for k, (b, w) in key.items()},
    }


def _shard(kind: str, model: nn.Module, world: int) -> nn.Module:
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Attn}),
                                    use_orig_params=kind == "fsdp1")


KINDS = ("fsdp2", "fsdp1", "fsdp1_flat")


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        idx = torch.randint(0, V, (BATCH * world, SEQ + 1), generator=torch.Generator().manual_seed(1))
        expected = _reference(idx)
        results = {}
        for kind in KINDS:
            torch.manual_seed(0)
            module = Net().double()
            root = _shard(kind, module, world)
            _loss(root, idx[rank * BATCH:(rank + 1) * BATCH]).backward()  # FSDP averages the ranks' gradients
            optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
            norm, layers = GradNormMonitor().measure(module, optimizer, root)
            zs = ZeroSumMonitor()
            zs.on_train_start(types.SimpleNamespace(model=root), module)
            key = zs._key_bias_values(optimizer, torch.device("cpu"))
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in root.parameters())
            results[kind] = {
                "global": norm, "layers": layers, "local_numel": local,
                "full_numel": sum(p.numel() for p in Net().parameters()),
                "key_layers": [kb.layer for kb in zs.key_biases],
                "key_bias_grad_norm": {k.split("/")[1]: float(v) for k, v in key.items() if k.endswith("_norm")},
                "key_bias_grad_ratio": {k.split("/")[1]: float(v) for k, v in key.items() if k.endswith("_ratio")},
            }
        Path(out, f"rank{rank}.json").write_text(json.dumps({"got": results, "expected": expected}))
        # Both ranks done with every collective before teardown: a rank that destroyed the group while
        # the other still had gloo work in flight aborted once ("terminate called without an active
        # exception", SIGABRT) in a fresh-clone CI run.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_gradient_norms_equal_the_unsharded_float64_norms(tmp_path):
    """fsdp2: DTensor gradients (Shard(0)); fsdp1: FlatParameter views of the original parameters
    (use_orig_params=True, Lightning's default), nested units; fsdp1_flat: use_orig_params=False, where the
    optimizer sees the flat parameters: the global norm holds, layers and key biases are not visible."""
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        data = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = data["expected"]
        for kind in KINDS:
            got = data["got"][kind]
            assert got["local_numel"] < got["full_numel"], kind  # this rank really held a part of the model
            assert got["global"] == pytest.approx(expected["global"], rel=1e-12), kind
            if kind == "fsdp1_flat":
                assert got["key_layers"] == []
                continue
            assert got["layers"].keys() == expected["layers"].keys() == {"emb", "blocks.0", "blocks.1", "head"}
            for layer, value in expected["layers"].items():
                assert got["layers"][layer] == pytest.approx(value, rel=1e-12), (kind, layer)
            assert got["key_layers"] == ["blocks.0", "blocks.1"], kind
            for signal in ("key_bias_grad_norm", "key_bias_grad_ratio"):
                assert got[signal].keys() == expected[signal].keys(), kind
                for layer, value in expected[signal].items():
                    assert got[signal][layer] == pytest.approx(value, rel=1e-12), (kind, signal, layer)
