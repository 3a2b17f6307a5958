"""What the sm_90 Gluon kernels' ahead-of-time builds must show (tests/test_hopper_forward.py, test_hopper_backward.py)."""

from __future__ import annotations

#: Shared memory one block may use on sm_90 (227 KB, the CUDA opt-in maximum on H100 / H200).
SM90_SHARED_MAX = 232448


def assert_hopper_kernel(kernel, min_wgmma: int) -> None:
    """sm_90a code with at least ``min_wgmma`` warp-group MMAs, TMA copies, mbarriers, the loader's register
    hand-off to the consumers (setmaxnreg) and shared memory within the sm_90 limit."""
    ptx = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async") >= min_wgmma
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier" in ptx
    assert "setmaxnreg" in ptx
    assert 0 < kernel.metadata.shared <= SM90_SHARED_MAX


def assert_softcap_code(ptx: str, softcap: bool) -> None:
    """The softcap's tanh is compiled in exactly when asked for: an ex2.approx.ftz (the softmax's exp2 lowers to one
    as well) and an rcp.approx.ftz per score, as the tl.dot kernels form it."""
    assert ("rcp.approx.ftz.f32" in ptx) == softcap
