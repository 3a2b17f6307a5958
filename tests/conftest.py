"""Fixtures shared by several test modules (opt-in: none of them is autouse)."""

from __future__ import annotations

import os
import sys

import pytest

# `python -m pytest` puts the working directory, the repository root, first on sys.path. There the source folder
# kernels/ (installed as lightning_gproj.kernels) shadows PyPI's `kernels` package, which transformers (5.25 and newer)
# finds and imports (`from kernels import CUDAProperties`): every test that builds a Hugging Face model then failed. The
# package is installed (README), so the tests never need the root on sys.path.
_REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _REPO]


@pytest.fixture
def recorder_off():
    """The test starts and ends with the global recorder off and empty."""
    from lightning_gproj import stats  # imported here: not every test module needs lightning

    stats.RECORDER.enabled = False
    stats.RECORDER.drain()
    yield
    stats.RECORDER.enabled = False
    stats.RECORDER.drain()
