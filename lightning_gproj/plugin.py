"""GProjPlugin: the GProj precision plugin for the Lightning ``Trainer``.

The logic lives in :class:`lightning_gproj.fabric.GProjFabricPlugin`; this class mixes it into the
Trainer's precision classes, as Lightning's ``TransformerEnginePrecision`` does, with the same
signature and :data:`~lightning_gproj.fabric.PRECISIONS` table. What only the Trainer has: it checks
that it converts a LightningModule attached to a Trainer (Fabric hands its model to a precision
plugin the same way, and a Trainer plugin there would crash at the first backward), and it logs the
calls each swapped module served and those that fell back to the Trainer's loggers after ``fit``.
"""

from __future__ import annotations

import weakref

from lightning.pytorch.plugins import precision as trainer_precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from .fabric import PRECISIONS, GProjFabricPlugin

__all__ = ["GProjPlugin", "PRECISIONS"]


class GProjPlugin(GProjFabricPlugin, trainer_precision.Precision):
    """Trainer precision plugin: GProj attention plus a base precision (the Trainer's classes).

    Arguments, attributes and errors as :class:`~lightning_gproj.fabric.GProjFabricPlugin`, with
    ``base`` a subclass of ``lightning.pytorch.plugins.precision.Precision`` (e.g. ``FSDPPrecision``
    under ``FSDPStrategy``). The instance is a ``GProj<Base>`` (e.g. ``GProjMixedPrecision``,
    ``GProjFSDPPrecision``). After ``fit``, the calls each swapped module served and those that fell
    back are printed and logged (``gproj_calls/{module}/served``, ``gproj_calls/{module}/fallbacks``).

    Raises (besides the shared ones):
        TypeError: at setup, when the module to convert is not a LightningModule attached to a
            Trainer (e.g. ``Fabric(plugins=[GProjPlugin()])``: use ``GProjFabricPlugin`` there).

    Example::

        trainer = Trainer(plugins=[GProjPlugin("bf16-mixed", fix="gproj")])
        trainer = Trainer(strategy=FSDPStrategy(), plugins=[GProjPlugin("bf16-mixed", base=FSDPPrecision)])
    """

    _gproj_lightning = trainer_precision
    _gproj_prefix = "GProj"
    _gproj_door = "Trainer(plugins=[...])"
    _gproj_other = "Fabric(plugins=[...]) takes lightning_gproj.GProjFabricPlugin"
    _gproj_refuse: tuple = ()
    _gproj_base: type = trainer_precision.Precision
    _gproj_info = staticmethod(rank_zero_info)

    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            raise TypeError(
                f"GProjPlugin is the Trainer's precision plugin: it converts a LightningModule attached to a "
                f"Trainer, got {type(module).__name__}. With Fabric(plugins=[...]) use "
                f"lightning_gproj.GProjFabricPlugin; to swap a model by hand, lightning_gproj.swap_attention."
            )
        self._gproj_trainer = weakref.ref(trainer)
        return super().convert_module(module)

    def _gproj_summary_due(self) -> bool:
        ref = self.__dict__.get("_gproj_trainer")
        trainer = ref() if ref is not None else None
        return trainer is not None and trainer.state.fn == "fit"

    def _gproj_report_calls(self) -> None:
        super()._gproj_report_calls()
        trainer = self._gproj_trainer()
        metrics = self._gproj_metrics()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
