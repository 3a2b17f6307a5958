"""Metric keys (lightning_gproj.callbacks.keys): built and parsed by one module, used by the monitors,
the offline replay and the dashboard."""

from __future__ import annotations

import pytest

from lightning_gproj.callbacks import keys


def test_layer_keys_round_trip_and_detector_keys_are_not_layer_keys():
    for layer in ("blocks.0.attn", "<root>", "attention", "enc/attn"):  # a stats_name may hold a '/'
        key = keys.metric("gproj", layer, "leak_ratio")
        assert keys.parse_layer_key("gproj", key) == (layer, "leak_ratio")
        for detector in keys.DETECTOR_STATS:
            assert keys.is_detector_key(keys.detector_key(key, detector))
            assert keys.parse_layer_key("gproj", keys.detector_key(key, detector)) is None
    assert keys.parse_layer_key("grad_norm", "gproj/a/leak_ratio") is None
    for key in ("gproj/leak_ratio", "alert/gproj/leak_ratio", "gprojx/a/leak_ratio", "gproj//x"):
        assert keys.parse_layer_key("gproj", key) is None, key
    with pytest.raises(ValueError, match="`detector`"):
        keys.detector_key("gproj/a/leak_ratio", "median")


def test_alert_keys_round_trip():
    assert keys.parse_alert_key(keys.alert_key("grad_norm/loss")) == "grad_norm/loss"
    assert keys.parse_alert_key("grad_norm/loss") is None
