"""Fixtures shared by several test modules (opt-in: none of them is autouse)."""

from __future__ import annotations

import pytest


@pytest.fixture
def recorder_off():
    """The test starts and ends with the global recorder off and empty."""
    from lightning_gproj import stats  # imported here: not every test module needs lightning

    stats.RECORDER.enabled = False
    stats.RECORDER.drain()
    yield
    stats.RECORDER.enabled = False
    stats.RECORDER.drain()
