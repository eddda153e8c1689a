"""Typed registries: the one way to extend foundryx.

Each registry maps a name (the key a YAML uses) to a Python object (a class or a factory
function). There are three ways in, and built-ins use the same one plugins do:

1. a Python entry point in group ``foundryx_<registry>``, e.g. in a plugin's pyproject.toml::

       [project.entry-points.foundryx_callbacks]
       my_callback = "my_pkg.callbacks:MyCallback"

   foundryx's own built-ins are declared exactly like this in its pyproject.toml;
2. the decorator ``@foundryx.registry.callbacks.register("my_callback")``;
3. the call ``foundryx.registry.callbacks.register("my_callback", MyCallback)``.

Every entry records where it came from (distribution and module). Two entries under one
name are an error naming both sources, unless the later one is marked as an override
(``register(..., override=True)``, or :func:`override` on an entry-point object). Asking
for an unknown name is an error that lists the close matches.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from foundryx.errors import RegistryError, did_you_mean

T = TypeVar("T")

RUNTIME = "<runtime>"  # source package of entries registered by decorator or call
_OVERRIDE_ATTR = "__foundryx_override__"


def override(obj: T) -> T:
    """Mark an entry-point object as deliberately replacing an entry of the same name."""
    setattr(obj, _OVERRIDE_ATTR, True)
    return obj


@dataclass
class Entry:
    """One registered object and its provenance."""

    name: str
    package: str  # distribution name ("foundryx", "foundryx-example-plugin") or <runtime>
    module: str
    override: bool = False
    how: str = "entry point"  # "entry point", "decorator" or "call"
    _obj: Any = None
    _ep: md.EntryPoint | None = field(default=None, repr=False)

    def load(self) -> Any:
        if self._obj is None and self._ep is not None:
            try:
                self._obj = self._ep.load()
            except Exception as e:  # noqa: BLE001 - a broken plugin must say which one
                raise RegistryError(
                    f"could not load {self.name!r} from {self.source} ({self._ep.value}): "
                    f"{type(e).__name__}: {e}. Fix or uninstall the package that provides it."
                ) from e
        return self._obj

    @property
    def target(self) -> str:
        """``module:attribute`` of the object, without loading it for an entry point."""
        if self._ep is not None:
            return self._ep.value.replace(" ", "")
        obj = self.load()
        return f"{obj.__module__}:{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"

    @property
    def source(self) -> str:
        return f"{self.package} ({self.module})"

    @property
    def kind(self) -> str:
        obj = self.load()
        if inspect.isclass(obj):
            return "class"
        if inspect.isfunction(obj) or inspect.ismethod(obj):
            return "function"
        return type(obj).__name__


class Registry(Generic[T]):
    """A named map from keys to objects, filled from entry points and registrations."""

    def __init__(self, name: str, description: str, check: Callable[[Any], bool] = callable):
        self.name = name
        self.description = description
        self.group = f"foundryx_{name}"
        self._check = check
        self._entries: dict[str, Entry] = {}
        self._discovered = False
        self._lock = threading.RLock()

    # -- registration -------------------------------------------------------------------
    def register(self, name: str | None = None, obj: Any = None, *, override: bool = False):
        """Register ``obj`` under ``name``; without ``obj``, return a decorator."""

        def add(o: Any, how: str) -> Any:
            key = name or getattr(o, "__name__", None)
            if not key:
                raise RegistryError(f"registry {self.name!r}: give a name for {o!r}")
            if not self._check(o):
                raise RegistryError(
                    f"registry {self.name!r}: {key!r} must be a class or a function, got {o!r}"
                )
            self._discover()
            self._add(
                Entry(key, RUNTIME, getattr(o, "__module__", "?"), override, how, _obj=o)
            )
            return o

        if obj is not None:
            return add(obj, "call")
        return lambda o: add(o, "decorator")

    def unregister(self, name: str) -> None:
        """Remove an entry (for tests and interactive sessions)."""
        with self._lock:
            self._entries.pop(name, None)

    def _add(self, entry: Entry) -> None:
        with self._lock:
            old = self._entries.get(entry.name)
            if old is not None and not entry.override:
                raise RegistryError(
                    f"two entries named {entry.name!r} in registry {self.name!r}: "
                    f"{old.source} and {entry.source}. Rename one, or mark the second as an "
                    f"override (register(..., override=True), or foundryx.registry.override(obj) "
                    f"for an entry point)."
                )
            self._entries[entry.name] = entry

    def _discover(self) -> None:
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            eps = list(md.entry_points(group=self.group))

            def pkg(ep: md.EntryPoint) -> str:
                return ep.dist.name if ep.dist is not None else "?"

            # Built-ins first, so a plugin colliding with one is the "second" entry.
            eps.sort(key=lambda ep: (pkg(ep) != "foundryx", pkg(ep), ep.name))
            for ep in eps:
                entry = Entry(ep.name, pkg(ep), ep.module, _ep=ep)
                old = self._entries.get(ep.name)
                if old is not None and old._ep is not None and (old.package, old._ep.value) == (entry.package, ep.value):
                    continue  # the same entry point seen twice (a package on sys.path twice)
                if old is not None:
                    entry.override = bool(getattr(entry.load(), _OVERRIDE_ATTR, False))
                self._add(entry)

    # -- lookup -------------------------------------------------------------------------
    def entry(self, name: str) -> Entry:
        self._discover()
        try:
            return self._entries[name]
        except KeyError:
            names = sorted(self._entries)
            hint = did_you_mean(name, names) or f"; known: {', '.join(names) or 'none'}"
            raise RegistryError(
                f"unknown {self.name[:-1] if self.name.endswith('s') else self.name} "
                f"{name!r} in registry {self.name!r}{hint}. "
                f"See `foundryx registry list {self.name}`."
            ) from None

    def get(self, name: str) -> T:
        return self.entry(name).load()

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {len(self.names())} entries)"


models: Registry = Registry("models", "ComposerModel classes or factories (cfg, tokenizer) -> model")
algorithms: Registry = Registry("algorithms", "Composer algorithm classes")
callbacks: Registry = Registry("callbacks", "Composer callback classes")
loggers: Registry = Registry("loggers", "Composer logger destinations")
optimizers: Registry = Registry("optimizers", "optimizer classes taking (params, **kwargs)")
schedulers: Registry = Registry("schedulers", "Composer scheduler classes")
dataloaders: Registry = Registry("dataloaders", "factories (cfg, tokenizer, batch_size) -> DataSpec")
tokenizers: Registry = Registry("tokenizers", "factories (**kwargs) -> PreTrainedTokenizerBase")
icl_tasks: Registry = Registry("icl_tasks", "in-context-learning task dataset builders")
metrics: Registry = Registry("metrics", "torchmetrics Metric classes")
attention_implementations: Registry = Registry(
    "attention_implementations", "attention functions (q, k, v, ...) -> out"
)
norms: Registry = Registry("norms", "normalisation layer classes (dim, eps)")
ffns: Registry = Registry("ffns", "feed-forward block classes (d_model, hidden, bias)")

REGISTRIES: dict[str, Registry] = {
    r.name: r
    for r in (
        models, algorithms, callbacks, loggers, optimizers, schedulers, dataloaders,
        tokenizers, icl_tasks, metrics, attention_implementations, norms, ffns,
    )
}


def get_registry(name: str) -> Registry:
    try:
        return REGISTRIES[name]
    except KeyError:
        raise RegistryError(
            f"unknown registry {name!r}{did_you_mean(name, REGISTRIES)}; "
            f"registries: {', '.join(REGISTRIES)}"
        ) from None
