"""Every error the package raises carries a ``HINT:`` (the promise at the top of docs/guides/troubleshooting.md).

Read from the source, not raised: each ``raise X(...)`` site, and each ``raise name`` whose name the function bound to
``X(...)``, is parsed, and the strings its message can be built from are collected: the literals in the call, the
module constants and local variables it names, and what the helpers it calls return (``bad_argument``,
``_no_match``, ...; followed into the package's other modules). One of them must hold ``HINT``; a helper counts only
when every one of its ``return``s does, not for a HINT anywhere in its body. The exceptions are the kinds the
troubleshooting page names: a message that says ``internal error`` (a bug in this package, to report), an
``OSError`` built from an errno (the operating system's message), and these, each checked rather than assumed:

- a re-raise that keeps its cause's message (``X(str(err))``) where ``err`` was caught as one of the package's own
  exception classes, whose raise sites this test checks too; a cause of any other class must be named in
  ``RELAYS`` with the reason its message has a hint;
- a raise inside a ``try`` whose handlers for that kind each raise a message with a hint of their own;
- the sites in ``RELAYS``, which re-raise another rank's error with that error's own message.
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
    # Re-raises of a built-in error's message: why that message has a hint.
    ("checkpoint/convert.py", "_check_destination", "UsageError"):
        "`atomic.check_replaceable`'s IsADirectoryError and FileExistsError carry a HINT (both stores)",
    ("checkpoint/io/remote.py", "_open_committed", "_renamed"):
        "re-raises the caught error itself, its message's temporary local path replaced by the URL",
    ("cli.py", "_lighthouse", "UsageError"):
        "`fault_tolerance.config.require_torchft`'s ModuleNotFoundError carries the `[ft]` install HINT",
    ("checkpoint/io/writers.py", "write_safetensors", "UsageError"):
        "`safetensors_layout.ordered`'s TypeError for a dtype safetensors lacks carries a HINT",
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
                found += _returned(module.functions[name], module, depth + 1)
            elif name in module.imports:
                other = _module(module.imports[name][0])
                target = module.imports[name][1]
                if target in other.functions:
                    found += _returned(other.functions[target], other, depth + 1)
    return found


def _own_nodes(function: ast.AST):
    """The nodes of a function's body, without those of the functions and classes defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _returned(function: ast.AST, module: _Module, depth: int) -> list[str]:
    """What a helper contributes to a message: ``HINT`` (or ``internal error``) only if every value it returns
    holds it. A HINT in one branch, a docstring or a comment-like string elsewhere in its body is not enough."""
    values = [n.value for n in _own_nodes(function) if isinstance(n, ast.Return) and n.value is not None
              and not (isinstance(n.value, ast.Constant) and n.value.value is None)]  # `return None`: no message
    texts = [" ".join(_strings(value, module, function, depth)) for value in values]
    return [marker for marker in ("HINT", "internal error") if texts and all(marker in t for t in texts)]


def _named(name: str, module: _Module, scope: ast.AST | None, depth: int) -> list[str]:
    found: list[str] = []
    if scope is not None:
        for sub in ast.walk(scope):
            if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and sub.value is not None:
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found += _strings(sub.value, module, scope, depth + 1)
            elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                  and sub.func.attr in {"append", "extend", "insert"}
                  and isinstance(sub.func.value, ast.Name) and sub.func.value.id == name):
                for arg in sub.args:  # `parts.append(f"HINT: {fix}")`
                    found += _strings(arg, module, scope, depth + 1)
    for value in module.constants.get(name, []):
        found += _strings(value, module, None, depth + 1)
    if name in module.imports:
        other = _module(module.imports[name][0])
        for value in other.constants.get(module.imports[name][1], []):
            found += _strings(value, other, None, depth + 1)
    return found


def _enclosing_functions(tree: ast.AST):
    """(raise node, innermost enclosing function, {exception name: handlers catching it around the raise}) for every
    raise in the tree."""
    def visit(node, function, caught):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            scope_caught = caught if inner is function else {}
            if isinstance(child, ast.Raise):
                yield child, inner, scope_caught
            elif isinstance(child, ast.Try):
                around = {kind: list(handlers) for kind, handlers in scope_caught.items()}
                for handler in child.handlers:
                    for name in _caught_names(handler):
                        around.setdefault(name, []).append(handler)
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), inner, around)
                for rest in (*child.handlers, *child.orelse, *child.finalbody):
                    yield from visit(ast.Module(body=[rest], type_ignores=[]), inner, scope_caught)
            else:
                yield from visit(child, inner, scope_caught)
    yield from visit(tree, None, {})


def _caught_names(handler: ast.ExceptHandler) -> set[str]:
    if handler.type is None:
        return {"BaseException"}
    return {ast.unparse(n) for n in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])}


def _own_exceptions(root: Path) -> set[str]:
    """The exception classes this package defines: their raise sites are checked here, so their messages have hints."""
    return {node.name for path in root.rglob("*.py") for node in _module(path).tree.body
            if isinstance(node, ast.ClassDef)
            and any(ast.unparse(b).endswith(("Error", "Exception", "Failure")) for b in node.bases)}


def _handler_of(name: str, site: ast.Raise, function: ast.AST | None) -> ast.ExceptHandler | None:
    """The ``except ... as name`` around ``site`` that binds ``name``."""
    for node in _own_nodes(function) if function is not None else ():
        if isinstance(node, ast.ExceptHandler) and node.name == name and any(n is site for n in ast.walk(node)):
            return node
    return None


def _constructed(name: str, function: ast.AST | None) -> list[ast.Call]:
    """The exceptions built into ``name`` in ``function`` (``error = FileNotFoundError(...)``), for ``raise name``."""
    calls = []
    for node in _own_nodes(function) if function is not None else ():
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            kind = ast.unparse(node.value.func).rsplit(".", 1)[-1]
            if kind.endswith(("Error", "Exception", "Failure", "Interrupt", "Exit")):
                calls.append(node.value)
    return calls


def _rewrapped(call: ast.Call) -> str | None:
    """The name of the caught error whose message ``X(str(err))`` or ``X(str(err).rstrip('.'))`` passes on."""
    if len(call.args) != 1 or call.keywords:
        return None
    arg = call.args[0]
    while isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in {"rstrip", "strip"}:
        arg = arg.func.value
    if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "str" and len(arg.args) == 1
            and isinstance(arg.args[0], ast.Name)):
        return arg.args[0].id
    return None


def _has_hint(call: ast.Call, module: _Module, function: ast.AST | None) -> bool:
    text = " ".join(_strings(call, module, function))
    return "HINT" in text or "internal error" in text


def raise_sites_without_a_hint(root: Path = PACKAGE) -> list[str]:
    missing = []
    own = _own_exceptions(root)
    for path in sorted(root.rglob("*.py")):
        module = _module(path)
        relative = str(path.relative_to(root))
        for node, function, caught in _enclosing_functions(module.tree):
            if isinstance(node.exc, ast.Name):  # `raise error`: check what the function built into it, if anything
                calls = _constructed(node.exc.id, function)
            else:
                calls = [node.exc] if isinstance(node.exc, ast.Call) else []
            for call in calls:
                if not (call.args or call.keywords):
                    continue  # `raise Error()` without a message of ours
                kind = ast.unparse(call.func)
                if kind == "SystemExit" or (function is not None and (relative, function.name, kind) in RELAYS):
                    continue
                if kind == "OSError" and len(call.args) >= 2:
                    continue
                if _has_hint(call, module, function):
                    continue
                cause = _rewrapped(call)
                handler = _handler_of(cause, node, function) if cause else None
                if handler is not None and _caught_names(handler) <= own:
                    continue  # passes on the message of one of our own errors, whose sites are checked here
                handlers = caught.get(kind, [])
                if handlers and all(_raises_with_a_hint(h, module, function) for h in handlers):
                    continue  # caught right around it, and raised again with a message that has a hint
                missing.append(f"{relative}:{node.lineno}: raise {ast.unparse(call)[:120]}")
    return missing


def _raises_with_a_hint(handler: ast.ExceptHandler, module: _Module, function: ast.AST | None) -> bool:
    raised = [n.exc for n in _own_nodes(handler) if isinstance(n, ast.Raise)]
    return bool(raised) and all(isinstance(exc, ast.Call) and _has_hint(exc, module, function) for exc in raised)


def test_every_raise_site_carries_a_hint():
    missing = raise_sites_without_a_hint()
    assert not missing, "raise sites whose message has no HINT:\n" + "\n".join(missing)


def test_the_reader_finds_a_site_without_a_hint(tmp_path):
    """The control: a message without a hint is found, however it is raised; one with a hint is not."""
    lines = [
        "X = 'HINT: pass 1.'",
        "class OurError(ValueError):",
        "    pass",
        "def _msg(v):",
        "    return f'bad {v}'",
        "def _half(v):",
        "    '''Says HINT: in its docstring and in one branch, not in the message it returns for v == 0.'''",
        "    if v:",
        "        return f'bad {v}. HINT: pass 1.'",
        "    return f'bad {v}'",
        "def _ours(v):",
        "    parts = [f'bad {v}.']",
        "    parts.append('HINT: pass 1.')",
        "    return ' '.join(parts)",
        "def f(v):",
        "    if v == 1:",
        "        raise ValueError(f'bad {v}. {X}')",  # 17: a hint
        "    if v == 2:",
        "        raise ValueError(_msg(v))",  # 19: found
        "    if v == 3:",
        "        raise KeyError(f'no entry {v!r}')",  # 21: found
        "    if v == 4:",
        "        raise ValueError(_half(v))",  # 23: found, a helper's HINT in one branch only
        "    if v == 5:",
        "        raise ValueError(_ours(v))",  # 25: a hint, appended
        "    if v == 6:",
        "        error = FileNotFoundError(f'no file {v}')",
        "        raise error",  # 28: found, raised by name
        "    try:",
        "        int(v)",
        "    except ValueError as err:",
        "        raise ValueError(str(err))",  # 32: found, a built-in error's message passed on
        "    try:",
        "        int(v)",
        "    except OurError as err:",
        "        raise ValueError(str(err))",  # 36: our own error's message, checked at its own sites
        "    try:",
        "        raise TypeError(f'bad {v}')",  # 38: caught, and raised again with a hint
        "    except TypeError as err:",
        "        raise ValueError(f'bad {v}. HINT: pass 1.') from err",
        "    try:",
        "        raise TypeError(f'bad {v}')",  # 42: found, caught and re-raised as it was
        "    except TypeError:",
        "        raise",
        "    raise RuntimeError('internal error: unreachable')",
    ]
    (tmp_path / "a.py").write_text("\n".join(lines) + "\n")
    missing = raise_sites_without_a_hint(tmp_path)
    assert [int(line.split(":")[1]) for line in missing] == [19, 21, 23, 28, 32, 42], missing


@pytest.mark.parametrize("relay", sorted(RELAYS))
def test_each_relay_is_still_there(relay):
    """An exemption that names a function the package no longer has would hide nothing, and should go."""
    path, function, kind = relay
    assert function in _module(PACKAGE / path).functions, relay
    raised = {ast.unparse(n.exc.func) for n in ast.walk(_module(PACKAGE / path).functions[function])
              if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)}
    assert kind in raised, relay
