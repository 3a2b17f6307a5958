"""Import the repository's scripts (examples/, benchmarks/), which are not part of the package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str) -> ModuleType:
    """The module at ``REPO/relpath``, imported once under ``name`` (later calls return the same one)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
