"""GProjPlugin: a Lightning precision plugin that swaps the model's attention, then converts it.

The plugin is a thin, idempotent, reporting swap (as Lightning's ``TransformerEnginePrecision``):
``convert_module`` calls :func:`lightning_gproj.swap.swap_attention`, prints its table on rank zero
and hands the module to the base precision. Everything else (autocast, scaler, dtype conversion,
checkpoint hooks) is the base precision's own code.

Why a dynamic subclass rather than a wrapper: strategies check the plugin's type (``FSDPStrategy``
raises TypeError unless the plugin is an ``FSDPPrecision``; DeepSpeed wants a ``DeepSpeedPrecision``).
``GProjPlugin(..., base=FSDPPrecision)`` returns an instance of a class derived from both
``GProjPlugin`` and ``FSDPPrecision`` (one class per base, cached), so both ``isinstance`` checks hold
and the base's methods run unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from .swap import SwapReport, swap_attention
from .swap._common import check_fix, check_patterns

#: Precision strings accepted by :class:`GProjPlugin`, with the base class used when ``base`` is None.
PRECISIONS: dict[str, type[Precision]] = {
    "bf16-mixed": MixedPrecision,
    "16-mixed": MixedPrecision,
    "32-true": Precision,
    "bf16-true": HalfPrecision,
    "16-true": HalfPrecision,
    "64-true": DoublePrecision,
}

_CLASSES: dict[type, type] = {}


def _gproj_class(base: type) -> type:
    """The cached class deriving from :class:`GProjPlugin` and ``base`` (``GProj<BaseName>``)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(
            f"GProj{base.__name__}",
            (GProjPlugin, base),
            {"__module__": __name__, "_gproj_base": base, "__doc__": f"GProjPlugin over {base.__qualname__}."},
        )
    return _CLASSES[base]


def _rebuild(base: type, state: dict) -> "GProjPlugin":
    plugin = object.__new__(_gproj_class(base))
    plugin.__dict__.update(state)
    return plugin


class GProjPlugin(Precision):
    """Precision plugin: GProj attention (:func:`lightning_gproj.ops.gproj_attn_func`) plus a base precision.

    Args:
        precision: the base precision, one of :data:`PRECISIONS` (default ``"bf16-mixed"``).
        fix: ``"gproj"`` (P-weighted projection, default), ``"none"`` (same kernel, no correction:
            the A/B baseline) or ``"gproj_uniform"``.
        include: glob pattern(s) over module paths selecting where attention is swapped (a match
            selects the module's subtree); None selects the whole model.
        exclude: glob pattern(s) whose modules (and subtrees) keep their attention.
        catch_all: also catch SDPA calls outside detected modules (see
            :func:`~lightning_gproj.swap.swap_attention`; costs a Python hop per torch call).
        base: the Lightning precision class to derive from, e.g. ``FSDPPrecision`` under
            ``FSDPStrategy`` or ``DeepSpeedPrecision`` under DeepSpeed. Default: from ``precision``
            (``MixedPrecision``, ``HalfPrecision``, ``Precision`` or ``DoublePrecision``).
        device: ``torch.autocast`` device for ``MixedPrecision`` (default ``"cuda"`` if available,
            else ``"cpu"``).
        **base_kwargs: further arguments for the base class's constructor (e.g. ``scaler``).

    The instance is a ``GProj<Base>`` (e.g. ``GProjMixedPrecision``, ``GProjFSDPPrecision``):
    ``isinstance(plugin, GProjPlugin)`` and ``isinstance(plugin, base)`` both hold. After
    :meth:`convert_module`, :attr:`report` holds the :class:`~lightning_gproj.swap.SwapReport`.

    Raises:
        ValueError: unknown ``precision`` or ``fix``, or a ``precision`` the base does not take.
        TypeError: ``base`` is not a Lightning ``Precision`` subclass; bad ``include``/``exclude``.

    Example::

        trainer = Trainer(plugins=[GProjPlugin("bf16-mixed", fix="gproj")])
        trainer = Trainer(strategy=FSDPStrategy(), plugins=[GProjPlugin("bf16-mixed", base=FSDPPrecision)])
    """

    _gproj_base: type = Precision

    def __new__(cls, *args: Any, base: Optional[type] = None, **kwargs: Any) -> "GProjPlugin":
        if base is None:
            if cls is not GProjPlugin:  # already a GProj<Base> class
                return super().__new__(cls)
            precision = kwargs.get("precision", args[0] if args else "bf16-mixed")
            base = PRECISIONS.get(_check_precision(precision))
        elif not (isinstance(base, type) and issubclass(base, Precision)):
            raise TypeError(
                f"`base` must be a subclass of lightning.pytorch.plugins.precision.Precision "
                f"(e.g. FSDPPrecision), got {base!r}"
            )
        if issubclass(base, GProjPlugin):
            base = base._gproj_base
        return super().__new__(_gproj_class(base))

    def __init__(
        self,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Union[None, str, Sequence[str]] = None,
        exclude: Union[None, str, Sequence[str]] = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        **base_kwargs: Any,
    ) -> None:
        _check_precision(precision)
        self._gproj_init(fix, include, exclude, catch_all)
        base_cls = self._gproj_base
        if issubclass(base_cls, MixedPrecision):
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            base_cls.__init__(self, precision, device, **base_kwargs)
        else:
            params = inspect.signature(base_cls.__init__).parameters
            if "precision" in params:
                base_cls.__init__(self, precision, **base_kwargs)
            else:
                base_cls.__init__(self, **base_kwargs)
        if getattr(self, "precision", None) != precision:
            raise ValueError(
                f"`precision={precision!r}` is not what the base {base_cls.__name__} runs "
                f"({getattr(self, 'precision', None)!r}); pick a matching `precision` or `base`"
            )

    def _gproj_init(self, fix: str, include: Any, exclude: Any, catch_all: bool) -> None:
        self.fix = check_fix(fix)
        self.include = check_patterns("include", include)
        self.exclude = check_patterns("exclude", exclude)
        if not isinstance(catch_all, bool):
            raise TypeError(f"`catch_all` must be a bool, got {catch_all!r}")
        self.catch_all = catch_all
        self.report: Optional[SwapReport] = None

    @classmethod
    def from_precision(
        cls,
        plugin: Precision,
        fix: str = "gproj",
        include: Union[None, str, Sequence[str]] = None,
        exclude: Union[None, str, Sequence[str]] = None,
        catch_all: bool = False,
    ) -> "GProjPlugin":
        """Wrap an already configured precision plugin (e.g. ``FSDPPrecision("bf16-mixed")`` with
        its scaler) without re-running its constructor: the result is a ``GProj<type(plugin)>``
        sharing the plugin's state (a shallow copy of its attributes)."""
        if not isinstance(plugin, Precision):
            raise TypeError(f"`plugin` must be a Lightning Precision instance, got {type(plugin).__name__}")
        base = plugin._gproj_base if isinstance(plugin, GProjPlugin) else type(plugin)
        new = object.__new__(_gproj_class(base))
        new.__dict__.update(plugin.__dict__)
        new._gproj_init(fix, include, exclude, catch_all)
        return new

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the attention of ``module`` in place (see :func:`~lightning_gproj.swap.swap_attention`),
        print the swap table on rank zero, then let the base precision convert the module.
        Idempotent: a second call re-reports and never double-wraps."""
        self.report = swap_attention(
            module, fix=self.fix, include=self.include, exclude=self.exclude, catch_all=self.catch_all
        )
        rank_zero_info(self.report.table())
        return super().convert_module(module)

    def __reduce__(self) -> tuple:
        # the GProj<Base> classes are made at run time: pickle (ddp_spawn, deepcopy) by base + state
        return _rebuild, (self._gproj_base, self.__dict__.copy())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={getattr(self, 'precision', None)!r}, fix={self.fix!r}, "
            f"include={self.include!r}, exclude={self.exclude!r})"
        )


def _check_precision(precision: object) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {tuple(PRECISIONS)}, got {precision!r}")
    return precision
