"""GProjFabricPlugin: :class:`~lightning_gproj.plugin.GProjPlugin`'s twin for ``lightning.fabric.Fabric``.

Fabric's precision plugins (``lightning.fabric.plugins.precision``) are other classes than the
Trainer's, with other method signatures (``backward(tensor, module)`` without a trainer,
``optimizer_step(optimizer)`` without a closure), so a Trainer plugin cannot serve Fabric. This twin
derives from Fabric's classes and shares the Trainer plugin's code (:mod:`lightning_gproj.plugin`):
``convert_module`` swaps the attention (:func:`lightning_gproj.swap.swap_attention`), prints the
table on rank zero, then hands the module to the base precision.

Example::

    fabric = Fabric(accelerator="cuda", plugins=[GProjFabricPlugin("bf16-mixed")])
    model, optimizer = fabric.setup(model, optimizer)   # attention swapped here
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import nn

from . import plugin as _plugin
from .swap import SwapReport
from .swap._common import check_ds_format

__all__ = ["GProjFabricPlugin", "PRECISIONS"]

#: Precision strings accepted by :class:`GProjFabricPlugin`, with the Fabric base class used when
#: ``base`` is None.
PRECISIONS: dict[str, type[Precision]] = {
    "bf16-mixed": MixedPrecision,
    "16-mixed": MixedPrecision,
    "32-true": Precision,
    "bf16-true": HalfPrecision,
    "16-true": HalfPrecision,
    "64-true": DoublePrecision,
}


class GProjFabricPlugin(Precision):
    """Fabric precision plugin: GProj attention plus a base Fabric precision.

    Arguments as :class:`~lightning_gproj.plugin.GProjPlugin` (``precision``, ``fix``, ``include``,
    ``exclude``, ``catch_all``, ``base``, ``device``, ``ds_format``, ``**base_kwargs``), with ``base`` a subclass of
    ``lightning.fabric.plugins.precision.Precision`` (e.g. Fabric's ``FSDPPrecision`` under
    ``FSDPStrategy``). The instance is a ``GProj<Base>`` deriving from both this class and ``base``.
    After ``fabric.setup(model)``, :attr:`report` holds the :class:`~lightning_gproj.swap.SwapReport`.

    Raises:
        ValueError: unknown ``precision`` or ``fix``, or a ``precision`` the base does not take.
        TypeError: ``base`` is not a Fabric ``Precision`` subclass; bad ``include``/``exclude``.
    """

    _gproj_base: type = Precision
    _gproj_refuse = ((TrainerPrecision, "is a Trainer precision plugin; use lightning_gproj.GProjPlugin with the Trainer"),)

    # The same parameters as __init__, spelled out: LightningCLI/jsonargparse read a class's
    # signature from __new__ when it defines one, and would otherwise refuse `precision`, `fix`, ...
    def __new__(
        cls,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Union[None, str, Sequence[str]] = None,
        exclude: Union[None, str, Sequence[str]] = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        ds_format: str = "bf16",
        **base_kwargs: Any,
    ) -> "GProjFabricPlugin":
        return super().__new__(_plugin._new(cls, GProjFabricPlugin, PRECISIONS, (), {"precision": precision}, base))

    def __init__(
        self,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Union[None, str, Sequence[str]] = None,
        exclude: Union[None, str, Sequence[str]] = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        ds_format: str = "bf16",
        **base_kwargs: Any,
    ) -> None:
        self.report: Optional[SwapReport]
        self.ds_format = check_ds_format(ds_format)
        _plugin._init(self, MixedPrecision, PRECISIONS, precision, fix, include, exclude, catch_all, device, base_kwargs)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the attention of ``module`` in place, print the swap table on rank zero, then let the
        base precision convert the module. Idempotent."""
        _plugin._convert(self, module)
        return super().convert_module(module)

    def forward_context(self) -> Any:
        _plugin._follow_device(self)
        return super().forward_context()

    def __reduce__(self) -> tuple:
        return _plugin._rebuild, (self._gproj_base, _plugin._state(self), GProjFabricPlugin)

    def __repr__(self) -> str:
        return _plugin._repr(self)
