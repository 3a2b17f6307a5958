"""What the sm_90 Gluon kernels' ahead-of-time builds must show (tests/test_hopper_forward.py, test_hopper_backward.py)."""

from __future__ import annotations

from lightning_gproj.kernels.attention_fwd_hopper import sass

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
    assert_wgmma_chained(kernel)


def assert_wgmma_chained(kernel) -> None:
    """ptxas did not serialize the warp-group MMAs. When it does (its -v prints "Potential Performance Loss:
    wgmma.mma_async instructions are serialized", C7512 / C7514), every HGMMA becomes a group of its own, waited
    for at once (``gsb0`` on each), and the k-steps of one GEMM no longer stream: run 19's pipelined forward was
    20–30% slower that way (benchmarks/NOTES.md, run 24). Chained, only a GEMM's last k-step carries gsb0."""
    hgmma = [line for line in sass(kernel).splitlines() if "HGMMA" in line]
    assert hgmma, "no HGMMA in the SASS"
    assert any("gsb0" not in line for line in hgmma), "every wgmma serialized (ptxas C7512 / C7514)"


def assert_softcap_code(ptx: str, softcap: bool) -> None:
    """The softcap's tanh is compiled in exactly when asked for: an ex2.approx.ftz (the softmax's exp2 lowers to one
    as well) and an rcp.approx.ftz per score, as the tl.dot kernels form it."""
    assert ("rcp.approx.ftz.f32" in ptx) == softcap


class Routed(Exception):
    """Raised by a stand-in for a Gluon pass: the call was routed to it."""


class TlDot(Exception):
    """Raised by a stand-in for a tl.dot kernel: the call stayed on it."""


class StubKernel:
    """Stands in for a triton.autotune'd kernel: ``kernel[grid](...)`` runs nothing, or raises ``exc``."""

    def __init__(self, exc=None):
        self.exc = exc

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if self.exc is not None:
                raise self.exc
        return launch
