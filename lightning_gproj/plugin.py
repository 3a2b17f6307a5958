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

Fabric's precision plugins are other classes (``lightning.fabric.plugins.Precision``, with other
method signatures); :class:`lightning_gproj.fabric.GProjFabricPlugin` is the twin for
``Fabric(plugins=[...])``, built from the same helpers below.

Autocast device: with ``device=None`` a mixed-precision plugin autocasts on the device type of the
converted module's parameters at each forward (where the Trainer / Fabric accelerator put them), so a
CPU run on a machine with CUDA autocasts on CPU.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from .swap import SwapReport, swap_attention
from .swap._common import check_ds_format, check_fix, check_patterns

#: Precision strings accepted by :class:`GProjPlugin`, with the base class used when ``base`` is None.
PRECISIONS: dict[str, type[Precision]] = {
    "bf16-mixed": MixedPrecision,
    "16-mixed": MixedPrecision,
    "32-true": Precision,
    "bf16-true": HalfPrecision,
    "16-true": HalfPrecision,
    "64-true": DoublePrecision,
}

_CLASSES: dict[tuple[type, type], type] = {}


def _gproj_class(base: type, root: Optional[type] = None) -> type:
    """The cached class deriving from ``root`` (default :class:`GProjPlugin`) and ``base``
    (``GProj<BaseName>``)."""
    root = root or GProjPlugin
    if (root, base) not in _CLASSES:
        _CLASSES[root, base] = type(
            f"GProj{base.__name__}",
            (root, base),
            {"__module__": root.__module__, "_gproj_base": base,
             "__doc__": f"{root.__name__} over {base.__module__}.{base.__qualname__}."},
        )
    return _CLASSES[root, base]


def _rebuild(base: type, state: dict, root: Optional[type] = None) -> Any:
    plugin = object.__new__(_gproj_class(base, root))
    plugin.__dict__.update(state)
    return plugin


def _new(cls: type, root: type, precisions: dict, args: tuple, kwargs: dict, base: Optional[type]) -> type:
    """The class ``root.__new__`` instantiates: ``GProj<base>`` for ``base`` or the precision's default."""
    if base is None:
        if cls is not root:  # already a GProj<Base> class
            return cls
        precision = kwargs.get("precision", args[0] if args else "bf16-mixed")
        base = precisions.get(_check_precision(precision, precisions))
    elif not (isinstance(base, type) and issubclass(base, root.__mro__[1])):
        lightning_base = root.__mro__[1]
        raise TypeError(
            f"`base` must be a subclass of {lightning_base.__module__.rpartition('.')[0]}.{lightning_base.__name__} "
            f"(e.g. FSDPPrecision), got {base!r}"
        )
    for refused, advice in getattr(root, "_gproj_refuse", ()):
        if issubclass(base, refused):  # Trainer precisions derive from Fabric's, with other signatures
            raise TypeError(f"`base` {base.__name__} {advice}")
    if issubclass(base, root):
        base = base._gproj_base
    return _gproj_class(base, root)


def check_device(device: Any) -> Optional[str]:
    """Return ``device`` if it is None or a device type ``torch.autocast`` accepts ("cpu", "cuda",
    "xpu", "mps", ...), else raise ValueError naming ``device``."""
    if device is None:
        return None
    ok = isinstance(device, str) and device.isidentifier()  # a type: "cuda", not "cuda:0"
    if ok:
        try:
            torch.autocast(device_type=device, enabled=False)
        except (RuntimeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"`device` must be None or a device type torch.autocast accepts (e.g. 'cpu', 'cuda', 'xpu', 'mps'), "
            f"got {device!r}"
        )
    return device


def _init(plugin: Any, mixed: type, precisions: dict, precision: str, fix: str, include: Any, exclude: Any,
          catch_all: bool, device: Optional[str], base_kwargs: dict) -> None:
    """``__init__`` of both plugins: GProj settings, then the base's own constructor."""
    _check_precision(precision, precisions)
    check_device(device)
    _gproj_init(plugin, fix, include, exclude, catch_all)
    base_cls = plugin._gproj_base
    if issubclass(base_cls, mixed):
        plugin._gproj_follow_device = device is None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        base_cls.__init__(plugin, precision, device, **base_kwargs)
    else:
        params = inspect.signature(base_cls.__init__).parameters
        if "precision" in params:
            base_cls.__init__(plugin, precision, **base_kwargs)
        else:
            base_cls.__init__(plugin, **base_kwargs)
    if getattr(plugin, "precision", None) != precision:
        raise ValueError(
            f"`precision={precision!r}` is not what the base {base_cls.__name__} runs "
            f"({getattr(plugin, 'precision', None)!r}); pick a matching `precision` or `base`"
        )


def _gproj_init(plugin: Any, fix: str, include: Any, exclude: Any, catch_all: bool) -> None:
    plugin.fix = check_fix(fix)
    plugin.include = check_patterns("include", include)
    plugin.exclude = check_patterns("exclude", exclude)
    if not isinstance(catch_all, bool):
        raise TypeError(f"`catch_all` must be a bool, got {catch_all!r}")
    plugin.catch_all = catch_all
    plugin.report: Optional[SwapReport] = None


#: Values accepted for ``GProjPlugin(attention_dtype=...)``: None (the op) or fp32 attention.
ATTENTION_DTYPES: dict[Optional[str], Optional[torch.dtype]] = {None: None, "fp32": torch.float32}


def check_attention_dtype(attention_dtype: object) -> Optional[str]:
    """Return ``attention_dtype`` if it is one of :data:`ATTENTION_DTYPES`, else raise ValueError."""
    if not (attention_dtype is None or isinstance(attention_dtype, str)) or attention_dtype not in ATTENTION_DTYPES:
        raise ValueError(f"`attention_dtype` must be one of {tuple(ATTENTION_DTYPES)}, got {attention_dtype!r}")
    return attention_dtype


def _convert(plugin: Any, module: nn.Module) -> None:
    """Swap, report on rank zero, and remember the module (for the autocast device)."""
    plugin.report = swap_attention(
        module, fix=plugin.fix, include=plugin.include, exclude=plugin.exclude, catch_all=plugin.catch_all,
        ds_format=getattr(plugin, "ds_format", "bf16"),
    )
    dtype = ATTENTION_DTYPES[getattr(plugin, "attention_dtype", None)]
    if dtype is not None:  # every swapped site runs SDPA in fp32 (Site.compute_dtype), `fix` unused
        for site in plugin.report.sites.values():
            site.compute_dtype = dtype
    rank_zero_info(plugin.report.table())
    plugin._gproj_module = weakref.ref(module)


def _follow_device(plugin: Any) -> None:
    """With ``device=None``: autocast where the converted module's parameters are."""
    if not plugin.__dict__.get("_gproj_follow_device") or plugin.__dict__.get("_gproj_module") is None:
        return
    module = plugin._gproj_module()
    param = next(module.parameters(), None) if module is not None else None
    if param is not None and param.device.type != plugin.device:
        plugin.device = param.device.type


def _state(plugin: Any) -> dict:
    state = plugin.__dict__.copy()
    state.pop("_gproj_module", None)  # a weak reference: not picklable, and the copy has no module yet
    return state


def _repr(plugin: Any) -> str:
    return (
        f"{type(plugin).__name__}(precision={getattr(plugin, 'precision', None)!r}, fix={plugin.fix!r}, "
        f"include={plugin.include!r}, exclude={plugin.exclude!r})"
    )


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
        attention_dtype: None (default: swapped attention runs the op with ``fix``) or ``"fp32"``: every
            swapped module runs its attention as fp32 SDPA (q, k, v cast up, output cast back; the
            monitors' "fp32" remediation, :attr:`Site.compute_dtype`) while the rest of the model
            keeps the base precision: the fp32-attention arm of an A/B/C comparison.
        ds_format: ``"bf16"`` (default), ``"e4m3"`` or ``"e5m2"``: how the op's backward rounds dS
            before the dQ/dK GEMMs (:func:`lightning_gproj.gproj_attn_func`); the FP8 significands are
            an accelerant for stress tests (docs/reproduction.md) and for FP8 research.
        device: ``torch.autocast`` device for ``MixedPrecision``. Default None: the device type of
            the converted module's parameters at each forward (the Trainer's accelerator); before
            conversion (and for the ``"16-mixed"`` grad scaler) ``"cuda"`` if available, else ``"cpu"``.
        **base_kwargs: further arguments for the base class's constructor (e.g. ``scaler``).

    The instance is a ``GProj<Base>`` (e.g. ``GProjMixedPrecision``, ``GProjFSDPPrecision``):
    ``isinstance(plugin, GProjPlugin)`` and ``isinstance(plugin, base)`` both hold. After
    :meth:`convert_module`, :attr:`report` holds the :class:`~lightning_gproj.swap.SwapReport`.

    Raises:
        ValueError: unknown ``precision``, ``fix``, ``attention_dtype`` or ``ds_format``, or a ``precision`` the
            base does not take.
        TypeError: ``base`` is not a Lightning ``Precision`` subclass; bad ``include``/``exclude``.

    Example::

        trainer = Trainer(plugins=[GProjPlugin("bf16-mixed", fix="gproj")])
        trainer = Trainer(strategy=FSDPStrategy(), plugins=[GProjPlugin("bf16-mixed", base=FSDPPrecision)])
    """

    _gproj_base: type = Precision

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
        attention_dtype: Optional[str] = None,
        ds_format: str = "bf16",
        **base_kwargs: Any,
    ) -> "GProjPlugin":
        return super().__new__(_new(cls, GProjPlugin, PRECISIONS, (), {"precision": precision}, base))

    def __init__(
        self,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Union[None, str, Sequence[str]] = None,
        exclude: Union[None, str, Sequence[str]] = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        attention_dtype: Optional[str] = None,
        ds_format: str = "bf16",
        **base_kwargs: Any,
    ) -> None:
        self.attention_dtype = check_attention_dtype(attention_dtype)
        self.ds_format = check_ds_format(ds_format)
        _init(self, MixedPrecision, PRECISIONS, precision, fix, include, exclude, catch_all, device, base_kwargs)

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
        _gproj_init(new, fix, include, exclude, catch_all)
        return new

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the attention of ``module`` in place (see :func:`~lightning_gproj.swap.swap_attention`),
        print the swap table on rank zero, then let the base precision convert the module.
        Idempotent: a second call re-reports and never double-wraps."""
        _convert(self, module)
        return super().convert_module(module)

    def forward_context(self) -> Any:
        _follow_device(self)
        return super().forward_context()

    def __reduce__(self) -> tuple:
        # the GProj<Base> classes are made at run time: pickle (ddp_spawn, deepcopy) by base + state
        return _rebuild, (self._gproj_base, _state(self))

    def __repr__(self) -> str:
        return _repr(self)


def _check_precision(precision: object, precisions: Optional[dict] = None) -> str:
    precisions = PRECISIONS if precisions is None else precisions
    if not isinstance(precision, str) or precision not in precisions:
        raise ValueError(f"`precision` must be one of {tuple(precisions)}, got {precision!r}")
    return precision
