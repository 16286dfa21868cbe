"""The type stubs (wsync/__init__.pyi) against the code: every exported name is in the stubs, every
stubbed name exists, and every stubbed function and method takes the parameters the code takes
(names, kinds, which have defaults)."""

import ast
import inspect
import os

import pytest

import wsync

STUB = os.path.join(os.path.dirname(wsync.__file__), "__init__.pyi")

# Signatures that take **kwargs and pass them on: the stub spells out what the target accepts.
FORWARDED = {
    "SharedMemoryTensorBridge.__init__": (wsync.WeightBridge.__init__, {"transport"}),
    "LocalCloneTensorBridge.__init__": (wsync.WeightBridge.__init__, {"transport"}),
    "make_weight_bridge": (wsync.WeightBridge.__init__, {"transport"}),
}


def stub_tree() -> ast.Module:
    if not os.path.exists(STUB):
        pytest.skip(f"{STUB} is not in the build tree (rebuild to copy it)")
    with open(STUB) as f:
        return ast.parse(f.read(), STUB)


def stub_params(fn: ast.FunctionDef) -> list:
    """(name, kind, has_default) of a stub function, self/cls left out."""
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = []
    for i, p in enumerate(positional):
        kind = "POSITIONAL_ONLY" if p in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append((p.arg, kind, i >= first_default))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "KEYWORD_ONLY", d is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False))
    if out and out[0][0] in ("self", "cls") and not _is_static(fn):
        out = out[1:]
    return out


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def runtime_params(obj, bound: bool) -> list:
    params = list(inspect.signature(obj).parameters.values())
    if bound and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params]


def stub_definitions():
    """Top-level names the stub defines: {name: node} (imports as their alias)."""
    out = {}
    for node in stub_tree().body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname == alias.name:  # "import X as X": a re-export
                    out[alias.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def check_signature(where: str, fn: ast.FunctionDef, runtime, bound: bool) -> None:
    want = stub_params(fn)
    if where in FORWARDED:
        target, dropped = FORWARDED[where]
        accepted = {n for n, _, _ in runtime_params(target, True)} - dropped
        have = runtime_params(runtime, bound)
        positional = [p for p in have if p[1] != "VAR_KEYWORD"]
        assert want[:len(positional)] == positional, (where, want, have)
        extra = {n for n, k, _ in want[len(positional):]}
        assert extra <= accepted, (where, extra - accepted)
        return
    have = runtime_params(runtime, bound)
    assert want == have, f"{where}: stub {want} != code {have}"


def test_every_export_is_stubbed_and_every_stub_exists():
    defined = stub_definitions()
    missing = sorted(set(wsync.__all__) - set(defined))
    assert not missing, f"exported but not in __init__.pyi: {missing}"
    for name in defined:
        if not name.startswith("_"):
            assert name in wsync.__all__, f"{name}: stubbed but not exported"
        assert hasattr(wsync, name), f"{name}: stubbed but wsync has no such attribute"


def test_stubbed_signatures_match_the_code():
    checked = 0
    for name, node in stub_definitions().items():
        runtime = getattr(wsync, name, None)
        if isinstance(node, ast.FunctionDef):
            check_signature(name, node, runtime, bound=False)
            checked += 1
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                where = f"{name}.{item.name}"
                assert hasattr(runtime, item.name), f"{where}: stubbed but not in the code"
                attr = inspect.getattr_static(runtime, item.name)
                if _is_property(item):
                    assert isinstance(attr, property) or type(attr).__name__ == "property", where
                    continue
                member = getattr(runtime, item.name)
                try:
                    inspect.signature(member)
                except ValueError:  # an extension method without a Python signature
                    continue
                if item.name == "__init__" and member is object.__init__:
                    continue
                check_signature(where, item, member,
                                bound=not isinstance(attr, staticmethod))
                checked += 1
    assert checked >= 30
