"""Why SDPA calls did not reach GProj in registry mode on the H200 (run 11): dispatcher state and the
backend SDPA picks while "GProj" is active. Usage: python benchmarks/registry_diag.py (an sm_90 GPU)"""
import argparse

argparse.ArgumentParser(description=__doc__).parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.nn.attention as A  # noqa: E402

import lightning_gproj.sdpa_registry as R  # noqa: E402

op = "aten::_scaled_dot_product_flash_attention"
print("torch", torch.__version__, "impls", A.list_flash_attention_impls(), "missing_api", R.missing_api())
q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
before = torch._C._dispatch_dump(op)
R.activate_sdpa_registry(fix="gproj")
print("current", A.current_flash_attention_impl(), "active()", R.active())
after = torch._C._dispatch_dump(op)
print("dump changed:", before != after)
print("\n".join(l for l in after.splitlines() if "CUDA" in l or "Python" in l)[:1500])
try:
    print("fused choice (1=flash,2=efficient,3=cudnn,0=math):",
          torch._fused_sdp_choice(q, k, v, None, 0.0, True))
except Exception as e:
    print("fused choice error", e)
print("flash_sdp_enabled", torch.backends.cuda.flash_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled())
c0 = (R.CALLS.forward, R.CALLS.backward) if hasattr(R.CALLS, "forward") else repr(R.CALLS)
o = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
print("direct op call: CALLS before", c0, "after", repr(R.CALLS))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.sum().backward()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)[:3000])
print("CALLS after SDPA", repr(R.CALLS))
R.restore_sdpa_registry()
