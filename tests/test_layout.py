"""The shape of the code a learner reads: refdec's modules import each other in layers (no cycle,
function-local imports included), model.py stays the paper's Transformer at a readable length, and
no function or class grows past what one reading holds. Parses the sources; a fraction of a second."""

from __future__ import annotations

import ast

from conftest import REPO

SOURCES = sorted((REPO / "refdec").rglob("*.py")) + [REPO / "decode.py", REPO / "train.py"]


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules: set[str]) -> set[str]:
    """The refdec modules `path` imports anywhere in its body (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node)}
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found |= subs or ({target} & modules)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found - {name}


def test_no_import_cycle_among_refdecs_modules():
    """Case: runner and htmlreport imported each other, and loading -> hf -> runner -> loading ran in a
    circle through function-local imports; the layers are errors/machine, inputs/exactness, the
    registry/plan/loading, the runner, reporting."""
    paths = [p for p in SOURCES if module_name(p).startswith("refdec")]
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d):] + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_model_py_is_short_and_no_function_or_class_outgrows_a_reading():
    """Case: model.py was 676 lines with the compute modes before the reference layers; Trainer was a
    328-line class branching on the training mode."""
    assert len((REPO / "refdec" / "model.py").read_text(encoding="utf-8").splitlines()) <= 420
    too_long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = 80 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                200 if isinstance(node, ast.ClassDef) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not too_long, too_long


def test_the_scripts_stay_thin():
    """Case: decode.py grew to 227 lines with the report's assembly and the page's header in it; the
    library holds the logic, the scripts parse, call and print."""
    assert len((REPO / "decode.py").read_text(encoding="utf-8").splitlines()) < 200
    assert len((REPO / "train.py").read_text(encoding="utf-8").splitlines()) < 200
