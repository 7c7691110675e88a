"""The package's folders are its layers, and imports go one way: fronts -> features -> checkpoint -> engine -> base
(docs/architecture.md). Read from the code's own imports (every ``import`` statement, those inside functions too), so
a new module or a new import that breaks the shape fails here, naming the module and the line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_fsdp

PACKAGE = Path(lightning_fsdp.__file__).parent
MAX_LINES = 500

# Highest first; a module may import its own layer and the layers after it. A module's layer is the longest prefix
# listed (the package root, which assembles the fronts, is above them all).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("root", ("lightning_fsdp",)),
    ("fronts", ("lightning_fsdp.fabric", "lightning_fsdp.trainer", "lightning_fsdp.cli", "lightning_fsdp.__main__",
                "lightning_fsdp._fronts")),
    ("features", ("lightning_fsdp.preemption", "lightning_fsdp.trainer_preemption", "lightning_fsdp.step_checkpoints",
                  "lightning_fsdp.pretrained", "lightning_fsdp.averaging", "lightning_fsdp.planner")),
    # Inside the checkpoint layer its sub-packages are layers too: the operations users call over how bytes move,
    # that they are the bytes saved, and what they look like on disk.
    ("checkpoint", ("lightning_fsdp.checkpoint",)),
    ("checkpoint.io", ("lightning_fsdp.checkpoint.io",)),
    ("checkpoint.integrity", ("lightning_fsdp.checkpoint.integrity",)),
    ("checkpoint.formats", ("lightning_fsdp.checkpoint.formats",)),
    ("engine", ("lightning_fsdp.engine",)),
    ("base", ("lightning_fsdp._base",)),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = file
    return found


def imports_of(name: str, file: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module of this package, line) for every import statement in ``file``."""
    is_package = file.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t.split(".")[0] == "lightning_fsdp" and t != name]
    return found


def graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    found = modules(root)
    return {name: imports_of(name, file, set(found)) for name, file in found.items()}


def layer_of(module: str) -> str:
    best = max((prefix for _, prefixes in LAYERS for prefix in prefixes  # the root package is only itself
                if module == prefix or module.startswith(prefix + ".") and prefix != "lightning_fsdp"),
               key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py")
    return next(name for name, prefixes in LAYERS if best in prefixes)


def backward_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import of a higher layer than the importing module's own, one line each."""
    problems = []
    for module, targets in imports.items():
        for target, line in targets:
            if RANK[layer_of(target)] < RANK[layer_of(module)]:
                problems.append(f"{module} (line {line}) imports {target}: {layer_of(module)} may not import"
                                f" {layer_of(target)}")
    return problems


def circles(imports: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every import circle between modules (each found once, from its smallest module)."""
    edges = {m: sorted({t for t, _ in targets if t in imports}) for m, targets in imports.items()}
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for nxt in edges[path[-1]]:
            if nxt == path[0]:
                found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])

    for start in sorted(edges):
        walk([start])
    return found


def test_no_import_goes_against_the_layers():
    assert backward_imports(graph()) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_a_new_top_level_module_must_be_given_a_layer():
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("lightning_fsdp.something_new")


def test_every_module_has_a_layer_and_every_package_says_what_it_owns():
    for name, file in modules().items():
        layer_of(name)
        if file.name == "__init__.py" and name != "lightning_fsdp":
            doc = ast.get_docstring(ast.parse(file.read_text())) or ""
            assert "May import" in doc, f"{file}: its docstring must say what the package owns and what it may import"


def test_no_file_over_500_lines():
    long = {str(f.relative_to(PACKAGE)): n for f in PACKAGE.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these files (at most {MAX_LINES} lines each): {long}"


@pytest.mark.parametrize("module, target, expected", [
    ("lightning_fsdp.engine.sharding", "lightning_fsdp.checkpoint.save", "engine may not import checkpoint"),
    ("lightning_fsdp._base.errors", "lightning_fsdp.engine.config", "base may not import engine"),
    ("lightning_fsdp.checkpoint.formats.layout", "lightning_fsdp.checkpoint.io.atomic",
     "checkpoint.formats may not import checkpoint.io"),
    ("lightning_fsdp.planner.step", "lightning_fsdp.fabric", "features may not import fronts"),
])
def test_the_checks_catch_a_backward_import_added_on_purpose(module, target, expected):
    imports = graph()
    imports[module] = [*imports[module], (target, 1)]
    assert any(expected in problem for problem in backward_imports(imports))


def test_the_checks_catch_a_circle_added_on_purpose():
    imports = graph()
    imports["lightning_fsdp.engine.mesh"] = [*imports["lightning_fsdp.engine.mesh"], ("lightning_fsdp.engine.sharding", 1)]
    imports["lightning_fsdp.engine.sharding"] = [*imports["lightning_fsdp.engine.sharding"], ("lightning_fsdp.engine.mesh", 1)]
    assert ["lightning_fsdp.engine.mesh", "lightning_fsdp.engine.sharding", "lightning_fsdp.engine.mesh"] in circles(imports)
