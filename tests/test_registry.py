"""Registries: three ways in, provenance, collisions, overrides, did-you-mean, entry points."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from foundryx import registry
from foundryx.errors import RegistryError
from foundryx.registry import Registry


def test_builtins_come_from_entry_points_with_provenance():
    e = registry.optimizers.entry("decoupled_adamw")
    assert e.package == "foundryx"
    assert e.module == "foundryx.optim.decoupled_adamw"
    assert e.how == "entry point"
    from foundryx.optim.decoupled_adamw import DecoupledAdamW

    assert registry.optimizers.get("decoupled_adamw") is DecoupledAdamW
    assert e.kind == "class"


def test_every_builtin_loads():
    for reg in registry.REGISTRIES.values():
        for name in reg.names():
            assert callable(reg.get(name)), (reg.name, name)


def test_decorator_and_call_register_and_record_source():
    reg = Registry("widgets", "test")

    @reg.register("spinner")
    class Spinner:
        pass

    def make_gear():
        return "gear"

    reg.register("gear", make_gear)
    assert reg.get("spinner") is Spinner
    assert reg.entry("spinner").how == "decorator"
    assert reg.entry("gear").how == "call"
    assert reg.entry("gear").module == __name__
    assert reg.entry("gear").kind == "function"
    assert reg.names() == ["gear", "spinner"]


def test_collision_names_both_sources_unless_override():
    reg = Registry("widgets", "test")
    reg.register("x", lambda: 1)
    with pytest.raises(RegistryError) as err:
        reg.register("x", lambda: 2)
    msg = str(err.value)
    assert "two entries named 'x'" in msg and msg.count(__name__) == 2
    assert "override" in msg

    def replacement():
        return 3

    reg.register("x", replacement, override=True)
    assert reg.get("x") is replacement


def test_runtime_registration_colliding_with_builtin_is_an_error():
    with pytest.raises(RegistryError, match=r"foundryx \(foundryx.optim.decoupled_adamw\)"):
        registry.optimizers.register("decoupled_adamw", lambda params: None)


def test_unknown_name_lists_close_matches():
    with pytest.raises(RegistryError) as err:
        registry.optimizers.get("decoupled_adamww")
    assert "did you mean 'decoupled_adamw'" in str(err.value)
    with pytest.raises(RegistryError) as err:
        registry.optimizers.get("zzz")
    assert "known: adamw" in str(err.value)


def test_unknown_registry_did_you_mean():
    with pytest.raises(RegistryError, match="did you mean 'callbacks'"):
        registry.get_registry("callback")


def test_rejects_non_callables():
    reg = Registry("widgets", "test")
    with pytest.raises(RegistryError, match="must be a class or a function"):
        reg.register("n", 42)


class _FakeDist:
    def __init__(self, name):
        self.name = name


def _fake_eps(monkeypatch, eps_by_pkg):
    """Make importlib.metadata report entry points of fake distributions."""
    eps = []
    for pkg, items in eps_by_pkg.items():
        for name, value in items:
            ep = md.EntryPoint(name=name, value=value, group="foundryx_widgets")
            eps.append(ep._for(_FakeDist(pkg)) if hasattr(ep, "_for") else ep)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [e for e in eps if e.group == group])


def test_entry_point_discovery_and_collision_between_packages(monkeypatch):
    _fake_eps(
        monkeypatch,
        {
            "pkg-a": [("join", "os.path:join")],
            "pkg-b": [("join", "posixpath:join"), ("split", "os.path:split")],
        },
    )
    reg = Registry("widgets", "test")
    with pytest.raises(RegistryError) as err:
        reg.names()
    assert "pkg-a (os.path)" in str(err.value) and "pkg-b (posixpath)" in str(err.value)


def test_entry_point_override_marker(monkeypatch):
    import posixpath

    from foundryx.registry import override

    def my_join(*a):
        return "/".join(a)

    override(my_join)
    monkeypatch.setattr(posixpath, "my_join", my_join, raising=False)
    _fake_eps(
        monkeypatch,
        {"foundryx": [("join", "os.path:join")], "pkg-b": [("join", "posixpath:my_join")]},
    )
    reg = Registry("widgets", "test")
    assert reg.get("join") is my_join
    assert reg.entry("join").package == "pkg-b"


def test_broken_plugin_names_itself(monkeypatch):
    _fake_eps(monkeypatch, {"pkg-broken": [("bad", "no_such_module_xyz:thing")]})
    reg = Registry("widgets", "test")
    with pytest.raises(RegistryError, match=r"could not load 'bad' from pkg-broken"):
        reg.get("bad")
