"""Swap a model's attention for :func:`lightning_gproj.ops.gproj_attn_func`, in place.

One file per target: :mod:`.sdpa` (modules calling ``F.scaled_dot_product_attention``), :mod:`.mha`
(``nn.MultiheadAttention``), :mod:`.flash_attn` (modules calling an imported ``flash_attn_func`` or
``flash_attn_varlen_func``) and
:mod:`.hf` (Hugging Face ``transformers`` models, through their attention registry).
:func:`swap_attention` walks the model once, swaps what it can serve exactly, and returns a
:class:`SwapReport` of what it did and what it left alone and why.
Parameter names never change, so state_dicts and checkpoints stay interchangeable with the plain model.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from torch import nn

from . import flash_attn, hf, mha, sdpa
from ._common import (
    FIXES, GProjFallbackError, GProjFallbackWarning, Site, SwapRow, check_ds_format, check_fix, check_patterns,
    display_path, shared_selection_reason,
)

__all__ = [
    "FIXES", "GProjFallbackError", "GProjFallbackWarning", "SwapReport", "SwapRow", "swap_attention", "unswap_attention",
]

Patterns = Union[None, str, Sequence[str]]

#: Width the notes of :meth:`SwapReport.table` and :meth:`SwapReport.calls_table` are wrapped to.
WIDTH = 100
_NOTE_INDENT = "    "


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]], notes: list[str]) -> list[str]:
    """A " | "-separated table, each row followed by its note (if any) wrapped to :data:`WIDTH` columns
    and indented, so a long note never widens the table."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), "-+-".join("-" * w for w in widths)]
    for row, note in zip(rows, notes):
        out.append(fmt.format(*row).rstrip())
        if note:
            out.extend(textwrap.wrap(note, WIDTH, initial_indent=_NOTE_INDENT, subsequent_indent=_NOTE_INDENT))
    return out


@dataclass
class SwapReport:
    """What :func:`swap_attention` did: one :class:`SwapRow` ``(module_path, original,
    replacement_or_None, reason)`` per attention module found (and per catch-all region).

    ``sites`` maps module paths to their live :class:`Site` (calls served, fallbacks by reason).
    A module reachable at several paths (held under two names, tied layers) has one row and one site,
    at its first path in ``model.named_modules()``; ``aliases`` maps that path to the others.
    """

    fix: str
    catch_all: bool = False
    rows: list[SwapRow] = field(default_factory=list)
    sites: dict[str, Site] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    #: True when a ``transformers`` model was found (its attention goes through the registry, so the
    #: note about SDPA calls from helpers does not apply).
    registry: bool = False
    #: How the plugin serves attention: always "swap" here (:class:`lightning_gproj.sdpa_registry.RegistryReport`
    #: reports ``mode="sdpa_registry"``); ``mode_note`` says why a swap serves when another mode was asked for.
    mode: str = "swap"
    mode_note: str = ""

    def shown(self, path: str) -> str:
        """``path`` as the tables show it: ``<root>`` for the root, other paths of the same module after it."""
        also = self.aliases.get(path)
        return display_path(path) + (f" (also: {', '.join(also)})" if also else "")

    @property
    def swapped(self) -> list[SwapRow]:
        """Rows whose module now runs the op."""
        return [row for row in self.rows if row.replacement is not None]

    @property
    def left_alone(self) -> list[SwapRow]:
        """Rows whose module keeps its original attention."""
        return [row for row in self.rows if row.replacement is None]

    @property
    def reconverted(self) -> bool:
        """True when every row is a module swapped by an earlier call ("already swapped")."""
        return bool(self.rows) and all(
            r.replacement is not None and r.reason.startswith("already swapped") for r in self.rows
        )

    def table(self) -> str:
        """A plain-text table: module path | original | replacement (or "left alone"), each row
        followed by its note (why it was left alone, which calls fall back), wrapped to :data:`WIDTH`
        columns; one line when every row is "already swapped" (a re-conversion of a converted model;
        see ``rows``)."""
        if self.reconverted:
            return f"GProj attention swap (fix={self.fix!r}): model already converted ({len(self.rows)} modules)"
        header = ("module", "original", "replacement")
        rows = [(self.shown(r.module_path), r.original, r.replacement or "left alone") for r in self.rows]
        notes = [r.reason for r in self.rows]
        if not rows:
            rows = [("-", "no attention found", "-")]
            notes = ["no SDPA- or flash_attn_func-calling module, no nn.MultiheadAttention, no transformers model"]
        out = [f"GProj attention swap (fix={self.fix!r}): {len(self.swapped)} swapped, {len(self.left_alone)} left alone"]
        out.extend(_columns(header, rows, notes))
        if not self.catch_all and not self.registry:
            out.extend(textwrap.wrap(
                "SDPA calls made through helpers outside these modules stay as they are; catch_all=True serves them",
                WIDTH,
            ))
        if self.mode_note:
            out.extend(textwrap.wrap(self.mode_note, WIDTH))
        return "\n".join(out)

    def calls_table(self) -> str:
        """Per swapped module: the calls served by the op and those that ran the original code, with
        the reasons — what the run really used. Empty string when nothing was swapped."""
        sites = {path: site for path, site in self.sites.items() if not site.keep}
        if not sites:
            return ""
        idle = [p for p, s in sites.items() if s.served == 0 and s.fallback_count > 0]
        head = f"GProj attention calls (fix={self.fix!r}): {len(sites)} swapped module{'s' if len(sites) != 1 else ''}"
        if idle:
            head += f", {len(idle)} served no call (the run used their original attention)"
        rows = [(self.shown(p), str(s.served), str(s.fallback_count)) for p, s in sites.items()]
        notes = ["fell back: " + "; ".join(f"{reason} ({n}×)" for reason, n in s.fallbacks.items()) if s.fallbacks else ""
                 for s in sites.values()]
        return "\n".join([head, *_columns(("module", "served", "fell back"), rows, notes)])

    def __str__(self) -> str:
        return self.table()


def swap_attention(
    model: nn.Module,
    fix: str = "gproj",
    include: Patterns = None,
    exclude: Patterns = None,
    catch_all: bool = False,
    ds_format: str = "bf16",
    strict: bool = False,
) -> SwapReport:
    """Route the attention of ``model`` to :func:`lightning_gproj.ops.gproj_attn_func`, in place.

    Targets: every ``nn.MultiheadAttention`` (class swapped to
    :class:`~lightning_gproj.swap.mha.GProjMultiheadAttention`, same parameters); every module
    whose class code reaches ``scaled_dot_product_attention`` (by name, an import under another name, a partial, a
    closure variable, a default argument or a class attribute; its ``forward`` wrapped in a
    ``TorchFunctionMode``; see :mod:`.sdpa`); every module whose class code names a
    ``flash_attn_func`` or ``flash_attn_varlen_func`` imported from ``flash_attn``,
    ``flash_attn_interface`` or ``flash_attn.cute`` (the name rebound in its module, packed sequences
    served by ``gproj_attn_varlen_func``; see :mod:`.flash_attn`); every ``transformers`` model
    (attention implementation set to ``"gproj"``, packed sequences included; its attention modules get
    a site; see :mod:`.hf`). Calls the
    op cannot reproduce exactly run the original code with one :class:`GProjFallbackWarning` per
    module.

    Args:
        model: the model; modified in place.
        fix: ``"gproj"`` (P-weighted, default), ``"none"`` (the same kernel without correction, for
            A/B runs) or ``"gproj_uniform"``; passed to every op call.
        include: glob pattern(s) over module paths (``fnmatch``; e.g. ``"blocks.*"``); a pattern
            matching a module also selects its descendants. None selects everything.
        exclude: glob pattern(s); a matching module and its descendants are left alone.
        catch_all: also wrap the forward of the topmost selected module(s) (the model itself when
            nothing is excluded) so that SDPA calls made from helpers outside any detected module
            (e.g. a model's own attention helper functions) are served too, and of the innermost selected
            modules whose class name contains "attention" or "attn", so those calls carry the
            layer's path as ``stats_name`` (others are named after the topmost module). Costs a
            Python hop on every torch call of the forward (about 7 µs on CPU; none once
            ``torch.compile`` traced it); with activation checkpointing, the recomputation must go
            through a wrapped module's ``forward``.
        ds_format: ``"bf16"`` (default), ``"e4m3"`` or ``"e5m2"``: how the op's backward rounds dS
            (see :func:`lightning_gproj.gproj_attn_func`; FP8 significands are for stress tests).
        strict: a call a swapped module cannot serve exactly raises
            :class:`~lightning_gproj.swap.GProjFallbackError` instead of running the original code.

    Returns:
        a :class:`SwapReport`. Idempotent: swapping a swapped model re-applies this call's
        arguments (``fix``, ``include``, ...) without wrapping anything twice, keeps each module's
        :class:`Site` (its call counts, restarted from 0 when ``fix`` changes, so that the calls summary
        counts only calls made under the fix it names) and reports "already swapped".

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``include``/``exclude`` are not None,
            a string or a sequence of strings, or ``catch_all``/``strict`` are not bools.
        ValueError: ``fix`` is not one of :data:`FIXES`, ``ds_format`` not one of ``DS_FORMATS``, an empty
            ``include``/``exclude`` pattern (it would match the root module, i.e. the whole model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    fix = check_fix(fix)
    check_ds_format(ds_format)
    include = check_patterns("include", include)
    exclude = check_patterns("exclude", exclude)
    if not isinstance(catch_all, bool):
        raise TypeError(f"`catch_all` must be a bool, got {catch_all!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"`strict` must be a bool, got {strict!r}")

    report = SwapReport(fix=fix, catch_all=catch_all)
    replacement = f"gproj_attn_func(fix={fix!r}" + ("" if ds_format == "bf16" else f", ds_format={ds_format!r}") + ")"
    modules = dict(model.named_modules(remove_duplicate=False))
    # a module held at several paths is swapped and reported once, at its first path
    paths: dict[int, list[str]] = {}
    for path, module in modules.items():
        paths.setdefault(id(module), []).append(path)
    first = {path: paths[id(module)][0] for path, module in modules.items()}
    not_selected = {path: shared_selection_reason(paths[id(module)], include, exclude) for path, module in modules.items()}

    # Undo any earlier swap first (keeping its sites, so counts survive): swapping twice then yields
    # exactly the structure of swapping once, whatever arguments either call had.
    previous = _sites(model)
    unswap_attention(model)
    for site in previous.values():
        if site.fix != fix:  # counts are of calls under the site's fix: a new fix starts them again
            site.served, site.fallbacks = 0, {}

    known_flash = flash_attn.originals()
    hf_reasons = _swap_hf_models(modules, not_selected)
    report.registry = bool(hf_reasons)

    for path, module in modules.items():
        if first[path] != path:
            continue
        reason = not_selected[path]
        old = previous.get(path)
        again = ["already swapped"] if old is not None and not old.keep else []
        bindings = flash_attn.call_sites(module, known_flash) if known_flash else []
        if path in hf_reasons:
            implementation = hf_reasons[path][1]
            module._gproj_hf_impl = implementation  # what its unserved calls run (hf._original_forward)
            original = f"{type(module).__name__}: transformers attention ({implementation!r})"
            reason = reason or hf_reasons[path][0]
            if reason is not None:
                report.rows.append(SwapRow(path, original, None, reason))
                continue
            report.sites[path] = hf.swap_module(module, path, fix, site=old)
            notes = again + [
                "packed sequences (position_ids restarting at 0, cu_seq_lens kwargs) served through the varlen op; "
                "sliding windows, softcap, attention dropout and right or left padding are served; other calls "
                "run the original attention (warns once)"]
            if implementation != "sdpa":
                notes.append(f"its masks are now built as for 'sdpa', not {implementation!r}")
            report.rows.append(SwapRow(path, original, f"{replacement} via AttentionInterface 'gproj'", "; ".join(notes)))
        elif bindings:
            names = ", ".join(f"{source} as {name}" for name, source in bindings)
            original = f"{type(module).__name__}: {names}"
            if reason is not None:
                flash_attn.swap_module(module, path, fix, bindings, keep=True)
                report.rows.append(SwapRow(path, original, None, reason))
                continue
            report.sites[path] = flash_attn.swap_module(module, path, fix, bindings, site=old)
            where = type(module).__module__
            notes = again + ["flash_attn_varlen_func calls served with their cu_seqlens; windows, softcap and dropout "
                             "are served; ALiBi, return_attn_probs, seqused/paged KV run the original (warns once)"]
            report.rows.append(SwapRow(path, original, f"{replacement} via rebinding in {where}", "; ".join(notes)))
        elif isinstance(module, nn.MultiheadAttention):
            original = "nn.MultiheadAttention"
            reason = reason or mha.static_reason(module)
            if reason is not None:
                report.rows.append(SwapRow(path, original, None, reason))
                continue
            report.sites[path] = mha.swap_module(module, path, fix, site=old)
            calls = ("need_weights=True (nn.MultiheadAttention's default: pass need_weights=False), key_padding_mask "
                     "other than right padding, non-causal masks")
            notes = again + [f"calls with {calls} run the original (warns once)"]
            report.rows.append(SwapRow(path, original, f"GProjMultiheadAttention, {replacement}", "; ".join(notes)))
        elif sdpa.calls_sdpa(module):
            original = f"{type(module).__name__}: F.scaled_dot_product_attention"
            if reason is not None:
                report.rows.append(SwapRow(path, original, None, reason))
                continue
            report.sites[path] = sdpa.swap_module(module, path, fix, site=old)
            report.rows.append(SwapRow(path, original, f"{replacement} via TorchFunctionMode", "; ".join(again)))

    if catch_all:
        _swap_catch_all(modules, first, not_selected, fix, report, previous)
    _keep_below_modes(modules, first, not_selected, fix, report)
    for row in report.rows:
        others = paths[id(modules[row.module_path])][1:]
        if others:
            report.aliases[row.module_path] = others
    for site in report.sites.values():
        site.strict = strict
        site.ds_format = ds_format
    return report


def _swap_hf_models(modules, not_selected) -> dict[str, tuple[Optional[str], str]]:
    """Set ``"gproj"`` on the topmost ``transformers`` models holding a selected attention module;
    returns ``{attention module path: (reason it cannot be swapped or None, original implementation)}``
    for the attention modules of every ``transformers`` model found."""
    out: dict[str, tuple[Optional[str], str]] = {}
    tops = [p for p, m in modules.items() if hf.is_pretrained(m)
            and not any(hf.is_pretrained(modules[a]) for a in _ancestors(p))]
    for top in tops:
        model = modules[top]
        inside = [p for p in modules if p != top and (top == "" or p.startswith(top + ".")) and hf.is_attention_module(modules[p])]
        original = model.__dict__.get("_gproj_hf_original", getattr(model.config, "_attn_implementation", None))
        reason = None
        if any(not_selected[p] is None for p in inside):
            reason = hf.swap_model(model)
        for p in inside:
            out[p] = (reason, original)
    return out


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))] if parts else []


def _parent(path: str) -> Optional[str]:
    return None if path == "" else path.rpartition(".")[0]


def _is_attention_class(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


def _swap_catch_all(modules, first, not_selected, fix, report, previous) -> None:
    """Wrap the topmost selected modules (catch-all) and the innermost selected modules whose class
    name says attention (so that their calls carry their own path as ``stats_name``), so that SDPA calls from
    anywhere in the selected region reach the op (:func:`_keep_below_modes` then keeps the unselected modules
    inside it on the original). ``first``: each path's module's first path, where it is swapped and reported."""
    named = [
        path for path, module in modules.items()
        if first[path] == path and not_selected[path] is None and path not in report.sites
        and _is_attention_class(module) and not isinstance(module, nn.MultiheadAttention)
    ]
    innermost = [p for p in named if not any(q.startswith(p + ".") or (p == "" and q) for q in named)]
    for path in innermost:
        old = previous.get(path)
        report.sites[path] = sdpa.swap_module(modules[path], path, fix, site=old)
        again = "already swapped; " if old is not None and not old.keep else ""
        report.rows.append(SwapRow(
            path, f"{type(modules[path]).__name__}: SDPA calls from helpers",
            f"gproj_attn_func(fix={fix!r}) via TorchFunctionMode (catch-all)",
            again + "attention by class name",
        ))
    for path, module in modules.items():
        parent = _parent(path)
        parent_selected = parent is not None and not_selected[parent] is None
        if not_selected[path] is None and not parent_selected and first[path] not in report.sites:
            path = first[path]
            old = previous.get(path)
            report.sites[path] = sdpa.swap_module(module, path, fix, site=old)
            report.sites[path].catch_all = True
            again = "already swapped; " if old is not None and not old.keep else ""
            report.rows.append(SwapRow(
                path, f"{type(module).__name__}: any other SDPA call inside",
                f"gproj_attn_func(fix={fix!r}) via TorchFunctionMode (catch-all)",
                again + "calls are named after this module",
            ))


def _inside(path: str, top: str) -> bool:
    return path != top and (top == "" or path.startswith(top + "."))


def _keep_below_modes(modules, first, not_selected, fix, report) -> None:
    """A module swapped through SDPA's TorchFunctionMode (an SDPA target or a catch-all) serves every SDPA call made
    while its forward runs, its descendants' included: wrap the topmost descendants that must keep the original SDPA
    — those not selected (``exclude``) and an ``nn.MultiheadAttention`` left alone, which calls SDPA internally —
    with ``keep=True`` (without it an excluded child's calls were served under the parent's name)."""
    modes = [path for path in report.sites if sdpa.swapped_site(modules[path]) is not None]
    if not modes:
        return
    reported = {row.module_path for row in report.rows}
    kept: list[str] = []
    for path, module in modules.items():
        if first[path] != path or path in report.sites or not any(_inside(path, top) for top in modes):
            continue
        if any(_inside(path, top) for top in kept):
            continue
        if not_selected[path] is not None or isinstance(module, nn.MultiheadAttention):
            sdpa.swap_module(module, path, fix, keep=True)
            kept.append(path)
            if not_selected[path] is not None and path not in reported:
                report.rows.append(SwapRow(path, type(module).__name__, None,
                                           f"{not_selected[path]}; SDPA calls inside keep the original"))


def _sites(model: nn.Module) -> dict[str, Site]:
    sites = {}
    for path, module in model.named_modules(remove_duplicate=False):
        site = sdpa.swapped_site(module) or getattr(module, "_gproj_site", None)
        if site is not None:
            sites[path] = site
    return sites


def unswap_attention(model: nn.Module) -> int:
    """Undo :func:`swap_attention` in place; returns the number of modules restored."""
    count = 0
    for module in model.modules():
        count += flash_attn.unswap_module(module)
        count += sdpa.unswap_module(module)
        count += mha.unswap_module(module)
        count += hf.unswap_module(module)
    return count
