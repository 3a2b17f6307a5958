"""GPU check of GProj in torch's flash-attention registry (lightning_gproj/sdpa_registry.py, mode="sdpa_registry").

Usage (CUDA, bf16-capable GPU; needs transformers for the model check)::

    python benchmarks/registry_check.py [--fix gproj]

With ``torch.nn.attention.activate_flash_attention_impl("GProj")`` active (through
``lightning_gproj.use_sdpa_registry``) it runs ``F.scaled_dot_product_attention`` in bf16 and checks, per case:

* causal, non-causal (Nq != Nk), GQA with ``enable_gqa=True``, and ``scale``: the call reached GProj
  (served forward and backward counts each +1) and o, dq, dk, dv equal ``gproj_attn_func``'s on the
  same inputs bit for bit — except GQA grads where this torch repeats k/v heads before the flash op
  (then dk, dv are sums over the group in another order: within 1e-2 relative, reported);
* a boolean-masked call: never reaches the flash backend (counts unchanged), o equal to the same call
  with GProj restored bit for bit, gradients within 1e-3 relative;
* a dropout call (``dropout_p=0.1``): reaches the flash backend and is served (forward and backward
  counts +1, no fallback, no GProjFallbackWarning), o, dq, dk, dv bit-identical to
  ``gproj_attn_func(dropout_p=0.1)`` after the same ``torch.manual_seed``;
* the SDPA priority order puts FLASH_ATTENTION first while active and is restored after;
* the model: a tiny Hugging Face Llama (``attn_implementation="sdpa"``, 2 layers, GQA 4:2, head dim 64)
  trained one step by ``L.Trainer(plugins=[GProjPlugin("bf16-mixed", mode="sdpa_registry")])``: 2 forward
  and 2 backward calls served, and the loss and every gradient within 2e-2 relative of the same step
  under the module swap (``mode="swap"``, which runs ``gproj_attn_func`` through transformers'
  registry; the two paths hand the kernels differently strided tensors, so the surrounding GEMMs may
  round differently), and torch's registry restored after ``fit``.

Prints one line per check and a table; exits 1 if any check fails. Where this torch lacks the registry,
it says so (naming the missing API and the torch version), checks that ``GProjPlugin(mode="sdpa_registry")``
warns and keeps the module swap, and exits 0 with "REGISTRY ABSENT" on the last line.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn.functional as F

import lightning_gproj
from lightning_gproj import sdpa_registry
from lightning_gproj.swap import GProjFallbackWarning

ROWS: list[tuple[str, str, str]] = []
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    ROWS.append((name, "ok" if ok else "FAIL", detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def inputs(b, h, hk, nq, nk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, device="cuda").bfloat16()
    k = (torch.randn(b, hk, nk, d, generator=g, device="cuda") + 4.0).bfloat16()
    v = torch.randn(b, hk, nk, d, generator=g, device="cuda").bfloat16()
    do = torch.randn(b, h, nq, d, generator=g, device="cuda").bfloat16()
    return q, k, v, do


def run_sdpa(q, k, v, do, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*leaves, **kwargs)
    o.backward(do)
    return (o.detach(), *(x.grad for x in leaves))


def run_gproj(q, k, v, do, fix, causal=False, scale=None, dropout_p=0.0):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = lightning_gproj.gproj_attn_func(*leaves, softmax_scale=scale, causal=causal, fix=fix, layout="bhsd",
                                        dropout_p=dropout_p)
    o.backward(do)
    return (o.detach(), *(x.grad for x in leaves))


def sdpa_checks(fix: str) -> None:
    from torch.nn.attention import SDPBackend

    flash = int(SDPBackend.FLASH_ATTENTION)
    order = torch._C._get_sdp_priority_order() if hasattr(torch._C, "_get_sdp_priority_order") else None
    cases = [
        ("causal 2x8x512x128", (2, 8, 8, 512, 512, 128), dict(is_causal=True)),
        ("non-causal Nq 300 < Nk 700, d 64", (2, 4, 4, 300, 700, 64), dict()),
        ("causal GQA 8:2 enable_gqa, d 64", (1, 8, 2, 1000, 1000, 64), dict(is_causal=True, enable_gqa=True)),
        ("non-causal scale=0.3, d 96", (1, 4, 4, 256, 256, 96), dict(scale=0.3)),
    ]
    with sdpa_registry.use_sdpa_registry(fix=fix) as calls:
        if order is not None:
            now = torch._C._get_sdp_priority_order()
            check("priority order while active", now[0] == flash, f"{order} -> {now}")
        for name, shape, kwargs in cases:
            q, k, v, do = inputs(*shape, seed=len(name))
            before = calls.snapshot()
            got = run_sdpa(q, k, v, do, **kwargs)
            torch.cuda.synchronize()
            after = calls.snapshot()
            served = (after[0] - before[0], after[1] - before[1])
            want = run_gproj(q, k, v, do, fix, causal=kwargs.get("is_causal", False), scale=kwargs.get("scale"))
            same = [torch.equal(a, b) for a, b in zip(got, want)]
            errs = [rel(a, b) for a, b in zip(got, want)]
            gqa = "enable_gqa" in kwargs
            ok = served == (1, 1) and same[0] and (all(same) or (gqa and max(errs) <= 1e-2))
            check(f"SDPA {name}", ok, f"served fwd/bwd {served}, bit-identical o/dq/dk/dv {same}, "
                                      f"max rel vs gproj_attn_func {max(errs):.1e}")
        # a boolean mask: SDPA's flash backend does not take masks; the call goes elsewhere
        q, k, v, do = inputs(2, 4, 4, 256, 256, 64, seed=7)
        mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
        before = calls.snapshot()
        masked = run_sdpa(q, k, v, do, attn_mask=mask)
        after_masked = calls.snapshot()
        # dropout: reaches the flash backend, served with GProj's own Philox mask
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(5)
            dropped = run_sdpa(q, k, v, do, dropout_p=0.1, is_causal=True)
        torch.cuda.synchronize()
        after_dropout = calls.snapshot()
        torch.manual_seed(5)
        want_dropped = run_gproj(q, k, v, do, fix, causal=True, dropout_p=0.1)
    check("masked call went to another backend", after_masked == before, f"counts {before} -> {after_masked}")
    restored = run_sdpa(q, k, v, do, attn_mask=mask)
    grad_err = max(rel(a, b) for a, b in zip(masked[1:], restored[1:]))
    check("masked call unchanged by GProj", torch.equal(masked[0], restored[0]) and grad_err <= 1e-3,
          f"o bit-identical, dq/dk/dv within {grad_err:.1e} (the backend's backward may accumulate atomically)")
    n_warn = sum(issubclass(w.category, GProjFallbackWarning) for w in caught)
    same = [torch.equal(a, b) for a, b in zip(dropped, want_dropped)]
    check("dropout call served by GProj",
          after_dropout == (after_masked[0] + 1, after_masked[1] + 1, after_masked[2]) and all(same) and n_warn == 0,
          f"counts {after_masked} -> {after_dropout}, bit-identical o/dq/dk/dv {same}, {n_warn} GProjFallbackWarning")
    import torch.nn.attention as attention

    check("restored after the block", attention.current_flash_attention_impl() is None
          and (order is None or torch._C._get_sdp_priority_order() == order),
          f"impl {attention.current_flash_attention_impl()!r}")


def model_check(fix: str) -> None:
    import lightning as L
    import transformers

    from lightning_gproj import GProjPlugin

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
            self.model = transformers.LlamaForCausalLM(config)
            self.grads: dict[str, torch.Tensor] = {}
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch, labels=batch)
            self.losses.append(float(out.loss.detach()))
            return out.loss

        def on_before_optimizer_step(self, optimizer):
            self.grads = {n: p.grad.detach().float().clone() for n, p in self.named_parameters() if p.grad is not None}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return torch.utils.data.DataLoader(torch.randint(0, 128, (2, 256), generator=g), batch_size=2)

    def fit(mode):
        module = LitLlama()
        trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            plugins=[GProjPlugin("bf16-mixed", fix=fix, mode=mode)])
        before = sdpa_registry.CALLS.snapshot()
        trainer.fit(module)
        after = sdpa_registry.CALLS.snapshot()
        return module, (after[0] - before[0], after[1] - before[1])

    registry, served = fit("sdpa_registry")
    swapped, served_swap = fit("swap")
    import torch.nn.attention as attention

    errs = {n: rel(registry.grads[n], g) for n, g in swapped.grads.items()}
    worst = max(errs, key=errs.get)
    loss_rel = abs(registry.losses[0] - swapped.losses[0]) / abs(swapped.losses[0])
    check("Llama step under GProjPlugin(mode='sdpa_registry')",
          served == (2, 2) and served_swap == (0, 0) and loss_rel <= 2e-2 and errs[worst] <= 2e-2
          and set(errs) == set(registry.grads) and attention.current_flash_attention_impl() is None,
          f"served fwd/bwd {served}, loss {registry.losses[0]:.6f} vs swap {swapped.losses[0]:.6f}, "
          f"worst grad rel {errs[worst]:.1e} ({worst}), {sum(v == 0 for v in errs.values())}/{len(errs)} grads identical")


def absent(missing: str) -> int:
    print(f"REGISTRY ABSENT: {missing}. GProjPlugin(mode='sdpa_registry') keeps the module swap here.", flush=True)
    from torch import nn

    import lightning as L

    from lightning_gproj import GProjFabricPlugin

    class Attn(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    plugin = GProjFabricPlugin("bf16-mixed", mode="sdpa_registry")
    fabric = L.Fabric(accelerator="cuda", devices=1, plugins=[plugin])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.setup(nn.Sequential(Attn()))
    named = [str(w.message) for w in caught if issubclass(w.category, GProjFallbackWarning)]
    check("fallback warning names the missing API", len(named) == 1 and missing in named[0], named[0] if named else "none")
    check("module swap kept", len(plugin.report.swapped) == 1, plugin.report.table().splitlines()[0])
    print("REGISTRY ABSENT")
    return 1 if FAILED else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", default="gproj", choices=lightning_gproj.FIXES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    missing = sdpa_registry.missing_api()
    if missing is not None:
        return absent(missing)
    sdpa_checks(args.fix)
    try:
        import transformers  # noqa: F401
    except ImportError:
        check("Llama step", False, "transformers not installed (pip install -e '.[hf]')")
    else:
        model_check(args.fix)
    width = max(len(r[0]) for r in ROWS)
    print("\ncheck".ljust(width + 1) + " | result | detail")
    for name, status, detail in ROWS:
        print(f"{name:<{width}} | {status:<6} | {detail}")
    print(f"\n{len(ROWS) - len(FAILED)}/{len(ROWS)} checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
