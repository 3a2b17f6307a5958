"""lightning-gproj: numerically safe BF16 attention training for PyTorch Lightning.

Public API::

    from lightning_gproj import gproj_attn_func, gproj_attn_varlen_func, GProjPlugin, ZeroSumMonitor, GradNormMonitor

See README.md and docs/design.md.
"""

import os as _os
from importlib.metadata import PackageNotFoundError, version

# In a source tree kernels/ and callbacks/ sit beside this folder (setup.cfg's package_dir installs them as
# lightning_gproj.kernels / .callbacks). Where this folder is imported from the tree itself — a plain install used from
# the clone's root, whose folder shadows the installed package — they are found there too.
_tree = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and _os.path.isfile(
        _os.path.join(_tree, "kernels", "__init__.py")):
    __path__.append(_tree)

from lightning_gproj.callbacks import Alert, GradNormMonitor, ZeroSumMonitor
from lightning_gproj.fabric import GProjFabricPlugin
from lightning_gproj.ops import DS_FORMATS, FIXES, gproj_attn_func, gproj_attn_varlen_func
from lightning_gproj.plugin import GProjPlugin
from lightning_gproj.sdpa_registry import activate_sdpa_registry, restore_sdpa_registry, use_sdpa_registry
from lightning_gproj.stats import RECORDER, StatsRecorder
from lightning_gproj.swap import GProjFallbackError, GProjFallbackWarning, SwapReport, swap_attention, unswap_attention

try:
    __version__ = version("lightning-gproj")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Alert",
    "DS_FORMATS",
    "FIXES",
    "GProjFabricPlugin",
    "GProjFallbackError",
    "GProjFallbackWarning",
    "GProjPlugin",
    "GradNormMonitor",
    "RECORDER",
    "StatsRecorder",
    "SwapReport",
    "ZeroSumMonitor",
    "activate_sdpa_registry",
    "gproj_attn_func",
    "gproj_attn_varlen_func",
    "restore_sdpa_registry",
    "swap_attention",
    "unswap_attention",
    "use_sdpa_registry",
]
