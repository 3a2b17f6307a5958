"""GProjFabricPlugin: the GProj precision plugin for ``lightning.fabric.Fabric``, and the logic both plugins share.

Lightning's own pattern (``lightning.fabric.plugins.precision.TransformerEnginePrecision`` and its
Trainer twin): the Fabric precision class holds the logic, and the Trainer class
(:class:`lightning_gproj.plugin.GProjPlugin`) mixes it into the Trainer's precision classes. Both take
one signature and one :data:`PRECISIONS` table. ``convert_module`` swaps the attention
(:func:`lightning_gproj.swap.swap_attention`), prints the table on rank zero and hands the module to
the base precision; the first optimizer step warns if a swapped module served none of its calls
(every call fell back); ``teardown`` prints (and the Trainer plugin logs) the calls each module
served and those that fell back.

Why a dynamic subclass rather than a wrapper: strategies check the plugin's type (``FSDPStrategy``
raises TypeError unless the plugin is an ``FSDPPrecision``; DeepSpeed wants a ``DeepSpeedPrecision``).
``GProjFabricPlugin(..., base=FSDPPrecision)`` returns an instance of a class derived from both the
front door and ``FSDPPrecision`` (one class per base, cached: ``GProjFabricFSDPPrecision`` here,
``GProjFSDPPrecision`` for the Trainer), so both ``isinstance`` checks hold and the base's methods run
unchanged.

Autocast device: with ``device=None`` a mixed-precision plugin autocasts on the device type of the
converted module's parameters at each forward (where the Trainer / Fabric accelerator put them), so a
CPU run on a machine with CUDA autocasts on CPU.

Example::

    fabric = Fabric(accelerator="cuda", plugins=[GProjFabricPlugin("bf16-mixed")])
    model, optimizer = fabric.setup(model, optimizer)   # attention swapped here
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import nn

from . import sdpa_registry
from .swap import GProjFallbackWarning, SwapReport, swap_attention
from .swap._common import check_ds_format, check_fix, check_patterns, display_path

__all__ = ["ATTENTION_DTYPES", "GProjFabricPlugin", "MODES", "PRECISIONS"]

#: Precision strings accepted by both plugins, with the name of the base class used when ``base`` is
#: None: Fabric's (``lightning.fabric.plugins.precision``) and the Trainer's
#: (``lightning.pytorch.plugins.precision``) precision modules each have a class of that name.
PRECISIONS: dict[str, str] = {
    "bf16-mixed": "MixedPrecision",
    "16-mixed": "MixedPrecision",
    "32-true": "Precision",
    "bf16-true": "HalfPrecision",
    "16-true": "HalfPrecision",
    "64-true": "DoublePrecision",
}

#: Values accepted for ``mode``: swap the model's attention modules, or serve every SDPA call that reaches
#: the flash backend through torch's flash-attention registry (:mod:`lightning_gproj.sdpa_registry`).
MODES = ("swap", "sdpa_registry")

#: Values accepted for ``attention_dtype``: None (the op in the dtype it is given), fp32 SDPA, or the
#: op on bf16 q, k, v whatever the base precision.
ATTENTION_DTYPES: dict[Optional[str], Optional[torch.dtype]] = {
    None: None, "fp32": torch.float32, "bf16": torch.bfloat16,
}

Patterns = Union[None, str, Sequence[str]]

_CLASSES: dict[tuple[type, type], type] = {}


def check_precision(precision: object) -> str:
    """Return ``precision`` as a key of :data:`PRECISIONS`, else raise ValueError. Lightning's legacy aliases
    (16, 32, 64, "16", "32", "64", "bf16"), which ``Trainer(precision=...)`` also takes, are converted by Lightning's
    own rule (lightning.fabric.connector, with its warning for 16 and "bf16")."""
    if not (isinstance(precision, str) and precision in PRECISIONS):
        try:
            precision = _convert_precision_to_unified_args(precision)
        except (TypeError, ValueError):  # not a precision Lightning knows: the error below names ours
            pass
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {tuple(PRECISIONS)} (or Lightning's aliases 16, 32, 64, 'bf16'), "
                         f"got {precision!r}")
    return precision


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


def check_mode(mode: object) -> str:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ValueError naming the accepted values."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    return mode


def check_attention_dtype(attention_dtype: object) -> Optional[str]:
    """Return ``attention_dtype`` if it is one of :data:`ATTENTION_DTYPES`, else raise ValueError."""
    if not (attention_dtype is None or isinstance(attention_dtype, str)) or attention_dtype not in ATTENTION_DTYPES:
        raise ValueError(f"`attention_dtype` must be one of {tuple(ATTENTION_DTYPES)}, got {attention_dtype!r}")
    return attention_dtype


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")
    return value


def _rebuild(root: type, base: type, state: dict) -> Any:
    plugin = object.__new__(root._gproj_class(base))
    plugin.__dict__.update(state)
    return plugin


class GProjFabricPlugin(fabric_precision.Precision):
    """Fabric precision plugin: GProj attention (:func:`lightning_gproj.ops.gproj_attn_func`) plus a base precision.

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
            (``MixedPrecision``, ``HalfPrecision``, ``Precision`` or ``DoublePrecision``). Fabric's
            classes here (``lightning.fabric.plugins.precision``), the Trainer's for
            :class:`~lightning_gproj.GProjPlugin`.
        device: ``torch.autocast`` device for ``MixedPrecision`` (other bases refuse it: ValueError).
            Default None: the device type of
            the converted module's parameters at each forward (the accelerator's); before
            conversion (and for the ``"16-mixed"`` grad scaler) ``"cuda"`` if available, else ``"cpu"``.
        attention_dtype: None (default: swapped attention runs the op with ``fix`` in the dtype it is
            given), ``"fp32"``: every swapped module runs its attention as fp32 SDPA (q, k, v cast up,
            output cast back; the monitors' "fp32" remediation, :attr:`Site.compute_dtype`) while the
            rest of the model keeps the base precision: the fp32-attention arm of an A/B/C comparison;
            or ``"bf16"``: every swapped module runs the op with ``fix`` on q, k, v cast to bf16 (output
            cast back, gradients returned in the inputs' dtype) whatever the base precision: BF16
            attention numerics in an otherwise fp32 model, e.g. ``"32-true"`` on a CPU without bf16
            instructions, where bf16-mixed runs every linear layer ~20× slower (README demo). The key
            gradient is then rounded through bf16 as under bf16-mixed, so its C2 residual
            ‖Σ_j dK_j‖/‖dK‖ reads ~1e-3 (as bf16-mixed's does), not the ~1e-7 of fp32 inputs through the op.
        ds_format: ``"bf16"`` (default), ``"e4m3"`` or ``"e5m2"``: how the op's backward rounds dS
            before the dQ/dK GEMMs (:func:`lightning_gproj.gproj_attn_func`); the FP8 significands are
            an accelerant for stress tests (docs/reproduction.md) and for FP8 research.
        strict: a call a swapped module cannot serve exactly (``need_weights=True``, left padding, float
            masks, ...) raises :class:`~lightning_gproj.swap.GProjFallbackError` instead of running the
            original attention with one warning (``mode="sdpa_registry"``: a flash-backend call with
            ``return_debug_mask``). Attention dropout is served (the op's ``dropout_p``).
        mode: ``"swap"`` (default): swap the model's attention modules (``include``, ``exclude``,
            ``catch_all`` and ``attention_dtype`` apply). ``"sdpa_registry"``: swap nothing; from
            ``convert_module`` to ``teardown`` GProj is torch's active flash-attention implementation
            (:mod:`lightning_gproj.sdpa_registry`), so every ``F.scaled_dot_product_attention`` call in
            the process that reaches SDPA's flash backend runs GProj with ``fix`` and ``ds_format``;
            calls SDPA sends elsewhere (masks, fp32, CPU) keep their kernels (docs/sdpa_registry.md).
            Where the installed torch lacks the registry, one warning names the missing API and the
            torch version, and the module swap serves instead.
        **base_kwargs: further arguments for the base class's constructor (e.g. ``scaler``).

    The instance is a ``GProjFabric<Base>`` (e.g. ``GProjFabricMixedPrecision``): both
    ``isinstance(plugin, GProjFabricPlugin)`` and ``isinstance(plugin, base)`` hold. After
    ``fabric.setup(model)``, :attr:`report` holds the :class:`~lightning_gproj.swap.SwapReport`, whose
    ``sites`` count the calls each module served and those that fell back;
    :meth:`calls_summary` renders them. The first optimizer step warns (:class:`GProjFallbackWarning`)
    when a swapped module served none of that step's calls.

    Raises:
        ValueError: unknown ``precision``, ``fix``, ``attention_dtype``, ``ds_format`` or ``mode``, a bad
            ``device`` (or any with a base that is not ``MixedPrecision``), a ``precision`` the base does not
            take, or an ``attention_dtype`` with ``mode="sdpa_registry"`` (fp32 attention never reaches the
            flash backend).
        TypeError: ``base`` is not a Fabric ``Precision`` subclass (a Trainer precision is refused:
            use :class:`~lightning_gproj.GProjPlugin` with the Trainer); bad ``include``/``exclude``;
            ``catch_all``/``strict`` not bools; a keyword argument the base's constructor refuses (e.g. a
            misspelt ``fixx=``: the message names it and lists the plugin's own arguments).

    Example::

        fabric = Fabric(plugins=[GProjFabricPlugin("bf16-mixed", fix="gproj")])
    """

    #: Lightning's precision module this front door derives from (the Trainer's for GProjPlugin).
    _gproj_lightning = fabric_precision
    #: Prefix of the derived classes' names: GProjFabric<Base>.
    _gproj_prefix = "GProjFabric"
    #: How users reach this front door, and the other one (for messages and str()).
    _gproj_door = "Fabric(plugins=[...])"
    _gproj_other = "Trainer(plugins=[...]) takes lightning_gproj.GProjPlugin"
    #: Base classes refused, with the advice given: Trainer precisions derive from Fabric's.
    _gproj_refuse: tuple = ((TrainerPrecision, "is a Trainer precision plugin; use lightning_gproj.GProjPlugin with the Trainer"),)
    _gproj_base: type = fabric_precision.Precision
    #: Rank-zero info of this front door's Lightning package (its logger prints to the console).
    _gproj_info = staticmethod(rank_zero_info)

    # The same parameters as __init__, spelled out: LightningCLI/jsonargparse read a class's
    # signature from __new__ when it defines one, and would otherwise refuse `precision`, `fix`, ...
    def __new__(
        cls,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Patterns = None,
        exclude: Patterns = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        attention_dtype: Optional[str] = None,
        ds_format: str = "bf16",
        strict: bool = False,
        mode: str = "swap",
        **base_kwargs: Any,
    ) -> "GProjFabricPlugin":
        if base is None and cls is cls._gproj_root():
            with warnings.catch_warnings():  # __init__ checks it again and lets Lightning's alias warning through
                warnings.simplefilter("ignore")
                key = check_precision(precision)
            base = getattr(cls._gproj_lightning, PRECISIONS[key])
        return super().__new__(cls._gproj_class(base))

    def __init__(
        self,
        precision: str = "bf16-mixed",
        fix: str = "gproj",
        include: Patterns = None,
        exclude: Patterns = None,
        catch_all: bool = False,
        base: Optional[type] = None,
        device: Optional[str] = None,
        attention_dtype: Optional[str] = None,
        ds_format: str = "bf16",
        strict: bool = False,
        mode: str = "swap",
        **base_kwargs: Any,
    ) -> None:
        precision = check_precision(precision)
        check_device(device)
        self.attention_dtype = check_attention_dtype(attention_dtype)
        self.ds_format = check_ds_format(ds_format)
        self._gproj_init(fix, include, exclude, catch_all, strict, mode)
        base_cls = self._gproj_base
        mixed = issubclass(base_cls, self._gproj_lightning.MixedPrecision)
        if device is not None and not mixed:
            raise ValueError(
                f"`device` sets the autocast device of a MixedPrecision base; base {base_cls.__name__} "
                f"(precision={precision!r}) takes none: leave `device` None, got {device!r}"
            )
        try:
            if mixed:
                self._gproj_follow_device = device is None
                device = device or ("cuda" if torch.cuda.is_available() else "cpu")
                base_cls.__init__(self, precision, device, **base_kwargs)
            elif "precision" in inspect.signature(base_cls.__init__).parameters:
                base_cls.__init__(self, precision, **base_kwargs)
            else:
                base_cls.__init__(self, **base_kwargs)
        except TypeError as exc:
            if not base_kwargs:
                raise
            # e.g. a misspelt argument: with precision="32-true" the base is Precision, whose constructor is
            # object's ("object.__init__() takes exactly one argument", naming neither the argument nor us)
            own = ", ".join(p for p in inspect.signature(GProjFabricPlugin.__init__).parameters if p not in ("self", "base_kwargs"))
            raise TypeError(
                f"{self._gproj_root().__name__} got keyword argument(s) {sorted(base_kwargs)} that are not its own "
                f"({own}); other keywords go to the base precision {base_cls.__name__}'s constructor, which refused "
                f"them: {exc}"
            ) from None
        if getattr(self, "precision", None) != precision:
            raise ValueError(
                f"`precision={precision!r}` is not what the base {base_cls.__name__} runs "
                f"({getattr(self, 'precision', None)!r}); pick a matching `precision` or `base`"
            )

    def _gproj_init(
        self, fix: str, include: Patterns, exclude: Patterns, catch_all: bool, strict: bool, mode: str = "swap"
    ) -> None:
        """The GProj settings and run state (the base's own state is set by its constructor)."""
        self.mode = check_mode(mode)
        if mode == "sdpa_registry" and self.attention_dtype is not None:
            raise ValueError(
                f"`attention_dtype={self.attention_dtype!r}` applies to swapped modules, and `mode='sdpa_registry'` "
                f"swaps none: it serves the SDPA calls that reach the flash backend in the dtype they come in. "
                f"Use mode='swap' with attention_dtype, or mode='sdpa_registry' without it and a 16-bit precision "
                f"('bf16-mixed', '16-mixed', 'bf16-true', '16-true')."
            )
        self.fix = check_fix(fix)
        self.include = check_patterns("include", include)
        self.exclude = check_patterns("exclude", exclude)
        self.catch_all = _check_bool("catch_all", catch_all)
        self.strict = _check_bool("strict", strict)
        self.report: Optional[Union[SwapReport, sdpa_registry.RegistryReport]] = None
        self._gproj_registry_on = False  # this plugin activated torch's registry and has not restored it yet
        # served / fallback counts per site when the first training forward began (see forward_context)
        self._gproj_counts: Optional[dict[str, tuple[int, int]]] = None
        self._gproj_stepped = False

    # ------------------------------------------------------------------ classes

    @classmethod
    def _gproj_root(cls) -> type:
        """The front door ``cls`` derives from (GProjFabricPlugin or GProjPlugin)."""
        return next(c for c in cls.__mro__ if "_gproj_lightning" in vars(c))

    @classmethod
    def _gproj_class(cls, base: Optional[type]) -> type:
        """The cached ``<prefix><Base>`` class deriving from this front door and ``base`` (None:
        ``cls`` itself, when it already is one)."""
        root = cls._gproj_root()
        if base is None:
            return cls
        lightning_base = root._gproj_lightning.Precision
        if not (isinstance(base, type) and issubclass(base, lightning_base)):
            raise TypeError(
                f"`base` must be a subclass of {root._gproj_lightning.__name__}.Precision (e.g. FSDPPrecision), "
                f"got {base!r}"
            )
        for refused, advice in root._gproj_refuse:
            if issubclass(base, refused):
                raise TypeError(f"`base` {base.__name__} {advice}")
        if issubclass(base, root):
            base = base._gproj_base
        if (root, base) not in _CLASSES:
            _CLASSES[root, base] = type(
                f"{root._gproj_prefix}{base.__name__}",
                (root, base),
                {"__module__": root.__module__, "_gproj_base": base,
                 "__doc__": f"{root.__name__} over {base.__module__}.{base.__qualname__}."},
            )
        return _CLASSES[root, base]

    @classmethod
    def from_precision(
        cls,
        plugin: fabric_precision.Precision,
        fix: str = "gproj",
        include: Patterns = None,
        exclude: Patterns = None,
        catch_all: bool = False,
        strict: bool = False,
        mode: str = "swap",
    ) -> "GProjFabricPlugin":
        """Wrap an already configured precision plugin (e.g. ``FSDPPrecision("bf16-mixed")`` with
        its scaler) without re-running its constructor: the result is a ``<prefix><type(plugin)>``
        sharing the plugin's state (a shallow copy of its attributes)."""
        root = cls._gproj_root()
        if not isinstance(plugin, root._gproj_lightning.Precision):
            raise TypeError(
                f"`plugin` must be a {root._gproj_lightning.__name__}.Precision instance, got {type(plugin).__name__}"
            )
        base = plugin._gproj_base if isinstance(plugin, root) else type(plugin)
        new = object.__new__(root._gproj_class(base))
        new.__dict__.update(plugin.__dict__)
        new.attention_dtype = getattr(plugin, "attention_dtype", None)
        new.ds_format = getattr(plugin, "ds_format", "bf16")
        new._gproj_init(fix, include, exclude, catch_all, strict, mode)
        return new

    # ------------------------------------------------------------------ Lightning hooks

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the attention of ``module`` in place (see :func:`~lightning_gproj.swap.swap_attention`),
        print the swap table on rank zero, then let the base precision convert the module.
        Idempotent: a second call never double-wraps, and prints nothing for a module it converted before.
        With ``mode="sdpa_registry"`` (and the registry present) it activates GProj in torch's registry instead."""
        if self.mode == "sdpa_registry":
            missing = sdpa_registry.missing_api()
            if missing is None:
                return self._gproj_convert_registry(module)
            if not self.__dict__.get("_gproj_registry_warned"):
                self._gproj_registry_warned = True
                rank_zero_warn(
                    f"GProj: mode='sdpa_registry' needs torch's flash-attention registry, but {missing}; "
                    f"keeping the module swap (mode='swap').",
                    category=GProjFallbackWarning,
                )
        self.report = swap_attention(
            module, fix=self.fix, include=self.include, exclude=self.exclude, catch_all=self.catch_all,
            strict=self.strict, ds_format=self.ds_format,
        )
        dtype = ATTENTION_DTYPES[self.attention_dtype]
        if dtype is not None:  # every swapped site runs in that dtype (Site.compute_dtype)
            for site in self.report.sites.values():
                site.compute_dtype = dtype
            how = "as fp32 SDPA (fix unused)" if self.attention_dtype == "fp32" else "through the op on bf16 q, k, v"
            self.report.mode_note = (f"attention_dtype={self.attention_dtype!r}: swapped attention runs {how}; "
                                     f"the rest of the model at precision {self.precision!r}")
        if self.mode == "sdpa_registry":
            self.report.mode_note = (
                "mode='sdpa_registry' asked for, but torch's flash-attention registry is missing; "
                "the module swap serves instead"
            )
        ref = self.__dict__.get("_gproj_module")
        if ref is None or ref() is not module:  # a re-conversion (validate, then fit) repeats nothing
            self._gproj_info(self.report.table())
        self._gproj_module = weakref.ref(module)
        return super().convert_module(module)

    def _gproj_convert_registry(self, module: nn.Module) -> nn.Module:
        """``mode="sdpa_registry"``: activate GProj in torch's registry (until ``teardown``); swap nothing."""
        if not self.__dict__.get("_gproj_registry_on"):
            sdpa_registry.activate_sdpa_registry(fix=self.fix, ds_format=self.ds_format, strict=self.strict)
            self._gproj_registry_on = True
            if self.precision in ("32-true", "64-true") and not self.__dict__.get("_gproj_precision_warned"):
                self._gproj_precision_warned = True  # said at setup: the first step does not repeat it
                rank_zero_warn(
                    f"GProj (mode='sdpa_registry') with precision={self.precision!r}: SDPA calls get fp32/fp64 "
                    f"tensors (unless the model casts them to bf16/fp16 itself), and those never reach the flash "
                    f"backend GProj serves. Use a 16-bit precision ('bf16-mixed', '16-mixed', 'bf16-true', "
                    f"'16-true'), or mode='swap' with attention_dtype='bf16'.",
                    category=GProjFallbackWarning,
                )
        ref = self.__dict__.get("_gproj_module")
        if self.report is None or ref is None or ref() is not module:
            self.report = sdpa_registry.RegistryReport(self.fix, self.ds_format)
            self._gproj_info(self.report.table())
        self._gproj_module = weakref.ref(module)
        return super().convert_module(module)

    def forward_context(self) -> Any:
        self._gproj_follow()
        if self._gproj_counts is None and self.report is not None and torch.is_grad_enabled():
            # the first training forward: what the first optimizer step's check compares against
            self._gproj_counts = {p: (s.served, s.fallback_count) for p, s in self.report.sites.items()}
            self._gproj_registry_counts = sdpa_registry.CALLS.snapshot()
        return super().forward_context()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        # After the step: the Trainer runs the training step's forward inside it (the closure).
        out = super().optimizer_step(*args, **kwargs)
        if not self._gproj_stepped:
            self._gproj_stepped = True
            self._gproj_check_first_step()
        return out

    def teardown(self) -> None:
        if self._gproj_summary_due():
            self._gproj_report_calls()
        if self.__dict__.get("_gproj_registry_on"):
            self._gproj_registry_on = False
            sdpa_registry.restore_sdpa_registry()
        super().teardown()

    # ------------------------------------------------------------------ GProj state

    def _gproj_follow(self) -> None:
        """With ``device=None``: autocast where the converted module's parameters are."""
        ref = self.__dict__.get("_gproj_module")
        if not self.__dict__.get("_gproj_follow_device") or ref is None:
            return
        module = ref()
        param = next(module.parameters(), None) if module is not None else None
        if param is not None and param.device.type != self.device:
            self.device = param.device.type

    def _gproj_check_first_step(self) -> None:
        """Warn when a swapped module fell back on every call of the first training step, or saw none."""
        if self.report is None:
            return
        if isinstance(self.report, sdpa_registry.RegistryReport):
            forward0, _, fell0 = self.__dict__.get("_gproj_registry_counts") or self.report.start
            forward, _, fell = sdpa_registry.CALLS.snapshot()
            if forward == forward0 and not self.__dict__.get("_gproj_precision_warned"):
                rank_zero_warn(
                    f"GProj (mode='sdpa_registry'): no F.scaled_dot_product_attention call of the first training step "
                    f"was served by GProj ({fell - fell0} flash-backend calls ran PyTorch's flash kernel; "
                    f"calls with attention masks, fp32 or CPU tensors never reach the flash backend). "
                    f"See docs/sdpa_registry.md, or use mode='swap'.",
                    category=GProjFallbackWarning,
                )
            return
        before = self._gproj_counts or {}
        idle, unseen = [], []
        for path, site in self.report.sites.items():
            served0, fell0 = before.get(path, (0, 0))
            if site.keep or site.served > served0:
                continue
            if site.fallback_count > fell0:
                idle.append(f"{display_path(path)} ({'; '.join(site.fallbacks)})")
            elif not site.catch_all:  # a catch-all region serves only what no swapped module inside serves
                unseen.append(display_path(path))
        if unseen:
            rank_zero_warn(
                f"GProj: {len(unseen)} of {len(self.report.swapped)} swapped attention modules saw no call in the first "
                f"training step: {', '.join(unseen)}. If the model reaches their attention through a method other "
                f"than forward (e.g. a parent calling a helper such as self.attn.attend(q, k, v)), those calls run the "
                f"original attention unseen: call the module itself, or pass catch_all=True, which also serves the SDPA "
                f"calls made anywhere inside the model's forward. A module simply unused in that step needs nothing.",
                category=GProjFallbackWarning,
            )
        if idle:
            rank_zero_warn(
                f"GProj: {len(idle)} of {len(self.report.swapped)} swapped attention modules served none of their "
                f"calls in the first training step, which ran their original attention: {', '.join(idle)}. "
                f"Remove the cause (e.g. need_weights=False, right instead of left padding) to train with GProj, or pass "
                f"strict=True to make any fallback an error.",
                category=GProjFallbackWarning,
            )

    def calls_summary(self) -> str:
        """The calls each swapped module served and those that fell back (:meth:`SwapReport.calls_table`);
        empty before ``convert_module``."""
        return self.report.calls_table() if self.report is not None else ""

    def _gproj_summary_due(self) -> bool:
        """Whether ``teardown`` reports the calls (the Trainer plugin: after ``fit`` only)."""
        return True

    def _gproj_metrics(self) -> dict[str, float]:
        """``gproj_calls/{module}/served`` and ``.../fallbacks`` for every swapped module
        (``mode="sdpa_registry"``: ``gproj_calls/sdpa_registry/...``, forward calls since activation)."""
        out: dict[str, float] = {}
        if isinstance(self.report, sdpa_registry.RegistryReport):
            forward, _, fell = self.report.counts()
            return {"gproj_calls/sdpa_registry/served": float(forward), "gproj_calls/sdpa_registry/fallbacks": float(fell)}
        for path, site in (self.report.sites.items() if self.report is not None else ()):
            if not site.keep:
                out[f"gproj_calls/{display_path(path)}/served"] = float(site.served)
                out[f"gproj_calls/{display_path(path)}/fallbacks"] = float(site.fallback_count)
        return out

    def _gproj_report_calls(self) -> None:
        """Print the calls summary on rank zero (Fabric has no logger to hand it to)."""
        summary = self.calls_summary()
        if summary:
            self._gproj_info(summary)

    def __reduce__(self) -> tuple:
        # the <prefix><Base> classes are made at run time: pickle (ddp_spawn, deepcopy) by base + state;
        # weak references (the module, the trainer) do not pickle, and a copy has neither yet;
        # a copy has not activated the registry (each process activates its own at convert_module)
        skip = ("_gproj_module", "_gproj_trainer", "_gproj_registry_on")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        return _rebuild, (self._gproj_root(), self._gproj_base, state)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={getattr(self, 'precision', None)!r}, fix={self.fix!r}, "
            f"include={self.include!r}, exclude={self.exclude!r}"
            + ("" if self.mode == "swap" else f", mode={self.mode!r}") + ")"
        )

    def __str__(self) -> str:
        # Lightning names a refused plugin by str(): say which front door this is and where the other is.
        return f"{self!r} (the {self._gproj_door} plugin; {self._gproj_other})"
