"""Every error the package raises carries a ``HINT:`` (the promise at the top of docs/guides/troubleshooting.md).

Read from the source, not raised: each ``raise X(...)`` site is parsed, and the strings its message can be built from
are collected: the literals in the call, the module constants and local variables it names, and the strings of the
helpers it calls (``bad_argument``, ``_no_match``, ...; followed into the package's other modules). One of them must
hold ``HINT``. The exceptions are the kinds the troubleshooting page names: a message that says ``internal error``
(a bug in this package, to report), an ``OSError`` built from an errno (the operating system's message), a plain
re-raise that keeps its cause's message (``X(str(err))``), and the sites in ``RELAYS``, which re-raise another rank's
error with that error's own message.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Every test here keeps one core busy (this process, or one subprocess at a time): they run first, beside the
# background pools (tests/conftest.py).
pytestmark = pytest.mark.single_process

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightning_fsdp"

# (file, function, exception) -> why the message raised there needs no hint of its own.
RELAYS = {
    ("checkpoint/integrity/agreement.py", "together", "OSError"): "re-raises the error another rank reported, with its message",
    ("checkpoint/integrity/agreement.py", "together", "kind"): "re-raises the error another rank reported, with its message",
    ("checkpoint/integrity/agreement.py", "together", "CheckpointError"): "the same, for a type that is not a built-in one",
    ("planner/command.py", "_run", "UsageError"): "names the option before the PlanningError, whose message has a hint",
    ("planner/command.py", "_load_file", "FileNotFoundError"): "the caller wraps it in `_import_failed`'s message",
    ("cli.py", "error", "UsageError"): "raised as is only when argparse's message already holds a HINT",
}


class _Module:
    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.functions: dict[str, ast.AST] = {}
        self.constants: dict[str, list[ast.AST]] = {}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module file, name there)
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
        for node in self.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        self.constants.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve(node)
                if source is not None:
                    for alias in node.names:
                        self.imports[alias.asname or alias.name] = (source, alias.name)

    def _resolve(self, node: ast.ImportFrom) -> str | None:
        if node.level:
            base = self.path.parent
            for _ in range(node.level - 1):
                base = base.parent
        elif (node.module or "").startswith("lightning_fsdp"):
            base = PACKAGE.parent
        else:
            return None
        parts = (node.module or "").split(".") if node.module else []
        target = base.joinpath(*parts)
        if target.with_suffix(".py").is_file():
            return str(target.with_suffix(".py"))
        if (target / "__init__.py").is_file():
            return str(target / "__init__.py")
        return None


_MODULES: dict[str, _Module] = {}


def _module(path: str | Path) -> _Module:
    key = str(path)
    if key not in _MODULES:
        _MODULES[key] = _Module(Path(key))
    return _MODULES[key]


def _strings(node: ast.AST, module: _Module, scope: ast.AST | None, depth: int = 0) -> list[str]:
    """The string literals a message expression can be made of."""
    found: list[str] = []
    if depth > 3:
        return found
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found.append(sub.value)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            found += _named(sub.id, module, scope, depth)
        elif isinstance(sub, ast.Call):
            name = sub.func.id if isinstance(sub.func, ast.Name) else getattr(sub.func, "attr", None)
            if name in module.functions and module.functions[name] is not scope:
                function = module.functions[name]
                found += _strings(function, module, function, depth + 1)
            elif name in module.imports:
                other = _module(module.imports[name][0])
                target = module.imports[name][1]
                if target in other.functions:
                    found += _strings(other.functions[target], other, other.functions[target], depth + 1)
    return found


def _named(name: str, module: _Module, scope: ast.AST | None, depth: int) -> list[str]:
    found: list[str] = []
    if scope is not None:
        for sub in ast.walk(scope):
            if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and sub.value is not None:
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found += _strings(sub.value, module, scope, depth + 1)
    for value in module.constants.get(name, []):
        found += _strings(value, module, None, depth + 1)
    if name in module.imports:
        other = _module(module.imports[name][0])
        for value in other.constants.get(module.imports[name][1], []):
            found += _strings(value, other, None, depth + 1)
    return found


def _enclosing_functions(tree: ast.AST):
    """(raise node, innermost enclosing function, exception names caught around it) for every raise in the tree."""
    def visit(node, function, caught):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            scope_caught = caught if inner is function else frozenset()
            if isinstance(child, ast.Raise):
                yield child, inner, scope_caught
            elif isinstance(child, ast.Try):
                names = {n.id for h in child.handlers if h.type is not None for n in ast.walk(h.type)
                         if isinstance(n, ast.Name)}
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), inner, scope_caught | names)
                for rest in (*child.handlers, *child.orelse, *child.finalbody):
                    yield from visit(ast.Module(body=[rest], type_ignores=[]), inner, scope_caught)
            else:
                yield from visit(child, inner, scope_caught)
    yield from visit(tree, None, frozenset())


def _is_rewrap(call: ast.Call) -> bool:
    """``X(str(err))``, ``X(str(err).rstrip('.'))``: the message is the cause's, which carries its own hint."""
    if len(call.args) != 1 or call.keywords:
        return False
    arg = call.args[0]
    while isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in {"rstrip", "strip"}:
        arg = arg.func.value
    return isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "str"


def raise_sites_without_a_hint(root: Path = PACKAGE) -> list[str]:
    missing = []
    for path in sorted(root.rglob("*.py")):
        module = _module(path)
        relative = str(path.relative_to(root))
        for node, function, caught in _enclosing_functions(module.tree):
            call = node.exc
            if not isinstance(call, ast.Call) or not (call.args or call.keywords):
                continue  # `raise`, `raise err`, `raise Error` without a message of ours
            kind = ast.unparse(call.func)
            if kind in caught:
                continue  # caught right around it, and raised again with a message of its own
            if kind == "SystemExit" or (function is not None and (relative, function.name, kind) in RELAYS):
                continue
            if kind == "OSError" and len(call.args) >= 2 or _is_rewrap(call):
                continue
            text = " ".join(_strings(call, module, function))
            if "HINT" in text or "internal error" in text:
                continue
            missing.append(f"{relative}:{node.lineno}: raise {ast.unparse(call)[:120]}")
    return missing


def test_every_raise_site_carries_a_hint():
    missing = raise_sites_without_a_hint()
    assert not missing, "raise sites whose message has no HINT:\n" + "\n".join(missing)


def test_the_reader_finds_a_site_without_a_hint(tmp_path):
    """The control: a message without a hint, plain or built by a helper, is found; one with a hint is not."""
    (tmp_path / "a.py").write_text(
        "X = 'HINT: pass 1.'\n"
        "def _msg(v):\n    return f'bad {v}'\n"
        "def f(v):\n"
        "    if v == 1:\n        raise ValueError(f'bad {v}. {X}')\n"
        "    if v == 2:\n        raise ValueError(_msg(v))\n"
        "    if v == 3:\n        raise KeyError(f'no entry {v!r}')\n"
        "    raise RuntimeError('internal error: unreachable')\n"
    )
    missing = raise_sites_without_a_hint(tmp_path)
    assert [line.split(":")[1] for line in missing] == ["8", "10"], missing


@pytest.mark.parametrize("relay", sorted(RELAYS))
def test_each_relay_is_still_there(relay):
    """An exemption that names a function the package no longer has would hide nothing, and should go."""
    path, function, kind = relay
    assert function in _module(PACKAGE / path).functions, relay
    raised = {ast.unparse(n.exc.func) for n in ast.walk(_module(PACKAGE / path).functions[function])
              if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)}
    assert kind in raised, relay
