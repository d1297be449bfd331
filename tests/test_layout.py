"""The shape of the code a learner reads: refdec's modules import each other in layers (no cycle,
function-local imports included, and none running back up from the model's layer to the decoders,
the runner, reporting, the commands or the transformers package), model.py stays the paper's Transformer
at a readable length, no function or class grows past what one reading holds, and docs/layout.md
names every module. Parses the sources; a fraction of a second."""

from __future__ import annotations

import ast
import io
import re
import tokenize

from conftest import REPO

SOURCES = sorted((REPO / "refdec").rglob("*.py")) + [REPO / "decode.py", REPO / "train.py"]


def wrapped_lines(text: str) -> set[int]:
    """The lines that continue a bracketed expression begun on an earlier line: the formatter's wrapping
    (one argument a line where a call does not fit), which a length for reading does not count."""
    depth, wrapped = 0, set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.NL and depth > 0:
            wrapped.add(tok.start[0] + 1)
    return wrapped


def reading_length(text: str, first: int = 1, last: int | None = None) -> int:
    """Lines first..last of text as a reader takes them in: every bracketed expression on one line."""
    last = len(text.splitlines()) if last is None else last
    return last - first + 1 - sum(first < n <= last for n in wrapped_lines(text))


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules: set[str]) -> set[str]:
    """The refdec modules `path` imports anywhere in its body, TYPE_CHECKING blocks included: an import
    made only for a type annotation is still an arrow a reader follows."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found |= subs or ({target} & modules)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    """Each refdec module -> the refdec modules it imports. Importing `refdec.decoding.verify` from
    outside refdec/decoding/ runs the package's __init__ too (which imports every decoder): an edge to
    `refdec.decoding` as well."""
    paths = [p for p in SOURCES if module_name(p).startswith("refdec")]
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    for m, targets in graph.items():
        for t in list(targets):
            parts = t.split(".")
            targets |= {
                p
                for p in (".".join(parts[:i]) for i in range(2, len(parts)))
                if p in modules and not (m + ".").startswith(p + ".")
            }
    return graph


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 for a module importing no other refdec module, else one above the highest
    module it imports (the graph has no cycle: the test below)."""
    floor: dict[str, int] = {}

    def of(m: str) -> int:
        if m not in floor:
            floor[m] = -1  # on the way down: met again only through an import cycle
            floor[m] = 1 + max((of(d) for d in graph[m]), default=-1)
        assert floor[m] >= 0, f"import cycle through {m}"
        return floor[m]

    for m in graph:
        of(m)
    return floor


def reached(graph: dict[str, set[str]], m: str) -> dict[str, list[str]]:
    """Every module `m` imports, directly or through others -> one chain of imports leading to it."""
    chains = {m: [m]}
    todo = [m]
    while todo:
        x = todo.pop()
        for d in sorted(graph[x]):
            if d not in chains:
                chains[d] = chains[x] + [d]
                todo.append(d)
    del chains[m]
    return chains


# The model's layer: the Transformer, its cache, the speed routes beside it, checkpoints, tokenizer, data,
# the one-line errors. None of them may import (directly, function-locally or through another module) the
# layers above.
MODEL_LAYER = [
    "refdec." + m
    for m in (
        "config",
        "presets",
        "errors",
        "model",
        "cache",
        "forced",
        "positions",
        "variants",
        "adapters",
        "checkpoint",
        "tokenizer",
        "data",
        "repo",
        "machine",
        "interrupt",
        "timing",
        "compiling",
        "progress",
        "metrics",
        "trace",
        "drafter",
        "proposal",
        "routes",
        "routes.kernels",
        "routes.int8",
        "routes.fast",
        "routes.graphed",
        "routes.probes",
    )
]
# The paper's model itself: what it is made of, below every route.
THE_MODEL = ["refdec." + m for m in ("config", "errors", "model", "cache", "forced", "positions", "variants")]
# The commands, on top, in one package; `refdec <command>` and `python -m refdec <command>` find each
# through refdec.commands' table (refdec.__main__, the one entry module), decode.py and train.py
# through their own.
COMMANDS = [
    "refdec.commands." + m
    for m in (
        "bench",
        "ceiling",
        "ctranslate2",
        "decode",
        "distill",
        "fuzz",
        "harness",
        "hfcli",
        "int8bench",
        "machine",
        "stepcost",
        "train",
        "train_drafters",
    )
]
ENTRIES = ["refdec.__main__"]
ABOVE_THE_MODEL = ("refdec.decoding", "refdec.app", "refdec.hf", "refdec.training", "refdec.commands", *ENTRIES)
ROUTES = (
    "refdec.routes.kernels",
    "refdec.routes.fast",
    "refdec.routes.graphed",
    "refdec.routes.int8",
    "refdec.routes.probes",
    "refdec.routes.products",
    "refdec.routes.stamps",
    "refdec.routes",
)


def test_no_import_cycle_among_refdecs_modules():
    """Case: runner and htmlreport imported each other, and loading -> hf -> runner -> loading ran in a
    circle through function-local imports; the layers are errors/machine, inputs/exactness, the
    registry/plan/loading, the runner, reporting."""
    graph = import_graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join((path + [m])[(path + [m]).index(d) :] + [d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_import_runs_back_up_from_the_models_layer():
    """Case: checkpoint.py imported decoding.adapters, which loads all seven decoders, so loading a
    checkpoint stood above the decoders it feeds (the adapters now sit beside the model). Each module's
    floor is derived from the import graph; every module of the model's layer stands below every
    decoder, the runner, reporting, loading, the registry, the transformers package and the commands,
    and imports none of them, directly or through another module."""
    graph = import_graph()
    assert set(MODEL_LAYER) <= set(graph) and set(COMMANDS + ENTRIES) <= set(graph)
    upward = [
        f"{m} reaches {d}: " + " -> ".join(chain)
        for m in MODEL_LAYER
        for d, chain in reached(graph, m).items()
        if d.startswith(ABOVE_THE_MODEL)
    ]
    assert not upward, upward
    floor = layers(graph)
    above = [m for m in graph if m.startswith(ABOVE_THE_MODEL)]
    assert max(floor[m] for m in MODEL_LAYER) < max(floor[m] for m in above)


def test_the_commands_stand_on_top_and_nothing_below_imports_them():
    """Case: ten commands lived flat among the library's modules, each with its own option parsing and
    report writing. They are one package now, refdec.commands, over one harness; no module outside it
    imports a command, directly or through another module, but the `python -m` entries (one module per
    command, calling its main, and refdec.hf's __main__), and each entry imports its own command alone.
    Now `python -m refdec <command>` (refdec.__main__) is the one entry: it imports the table of
    commands, refdec.commands, alone (which imports a command's module only when it runs)."""
    graph = import_graph()
    assert set(COMMANDS) <= set(graph), sorted(set(COMMANDS) - set(graph))
    below = [
        f"{m} reaches {d}: " + " -> ".join(chain)
        for m in graph
        if not m.startswith("refdec.commands") and m not in ENTRIES
        for d, chain in reached(graph, m).items()
        if d.startswith("refdec.commands")
    ]
    assert not below, below
    assert graph["refdec.__main__"] == {"refdec.commands"}
    assert graph["refdec.commands"] <= {"refdec"}, graph["refdec.commands"]  # its __version__, for --version


def test_the_package_root_holds_no_command_shim():
    """Case: the package root held eight 5-line `python -m refdec.X` modules beside the library (and
    refdec.hf a __main__ running back up into the commands), and an installed copy had no command to
    decode with. One command line now, refdec.__main__ and the `refdec` entry point over
    refdec.commands.COMMANDS: no module outside refdec/commands/ runs as a program, each command named
    in the table exists, and decode.py and train.py are its thin scripts."""
    import tomllib

    from refdec.commands import COMMANDS as TABLE

    programs = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "refdec").rglob("*.py")
        if p.parent.name != "commands"
        and '__name__ == "__main__"' in p.read_text(encoding="utf-8")
        or p.name == "__main__.py"
    ]
    assert programs == ["refdec/__main__.py"], programs
    assert {f"refdec.commands.{module}" for module, _ in TABLE.values()} <= set(COMMANDS) - {"refdec.commands.harness"}
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts == {"refdec": "refdec.commands:main"}
    for name in ("decode", "train"):
        code = (REPO / f"{name}.py").read_text(encoding="utf-8")
        assert f"from refdec.commands.{name} import main" in code and len(code.splitlines()) < 20, name


def test_no_package_and_the_modules_around_it_import_each_other():
    """Case: loading.py read transformers folders with refdec.hf, whose audit stood on the runner and on
    loading: drawn with each package (decoding, training, hf) as one box, an import ran back up. The
    audit and its command now stand beside the other commands. A package's __main__ is its command
    line, a script on top like decode.py, not a part of the box."""

    def box(m: str) -> str:
        return m if m.endswith(".__main__") else ".".join(m.split(".")[:2])

    boxes: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        boxes.setdefault(box(m), set()).update(box(t) for t in targets if box(t) != box(m))
    circles = [
        " -> ".join(chain + [b]) for b in sorted(boxes) for d, chain in reached(boxes, b).items() if b in boxes[d]
    ]
    assert not circles, circles


def test_the_model_reaches_no_route():
    """Case: model.py's attention and output projection switched on the compute modes that
    kernels.py set, kernels.py switched to the int8 products, and Memory carried the projection copy:
    the paper's model imported the speed routes. Now the routes import the model and put routed
    leaves in a twin of it; the model, its cache and what they are made of reach no route, directly or through
    another module, and no route reaches a checkpoint, an adapter or a decoder."""
    graph = import_graph()
    assert set(ROUTES) <= set(graph)
    for m in THE_MODEL:
        assert not set(reached(graph, m)) & set(ROUTES), f"{m} reaches {set(reached(graph, m)) & set(ROUTES)}"
    made_of = set(THE_MODEL).union(*(reached(graph, m) for m in THE_MODEL))  # errors' own import too (interrupt)
    for route in ROUTES:
        leaves = {"refdec.timing"}  # the one timing helper, which the probes time with (it imports torch alone)
        assert set(reached(graph, route)) <= made_of | set(ROUTES) | leaves, f"{route}: {reached(graph, route)}"


def test_no_test_module_imports_another():
    """Case: eight test modules imported helpers from other test files (`from test_batched import ...`),
    so running one file ran another's imports and a helper's home depended on who wrote it first. What
    several modules share lives in conftest.py, or hf_helpers.py when it needs transformers."""
    borrowed = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            borrowed += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("test_")]
    assert not borrowed, borrowed


def test_model_py_is_short_and_no_function_or_class_outgrows_a_reading():
    """Case: model.py was 676 lines with the compute modes before the reference layers; Trainer was a
    328-line class branching on the training mode."""
    assert reading_length((REPO / "refdec" / "model.py").read_text(encoding="utf-8")) <= 400
    too_long = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            limit = (
                80
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else 200
                if isinstance(node, ast.ClassDef)
                else None
            )
            if limit and reading_length(text, node.lineno, node.end_lineno) > limit:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not too_long, too_long


def test_the_commands_stay_thin():
    """Case: decode.py grew to 227 lines with the report's assembly and the page's header in it; the
    library holds the logic, the commands parse, call and print."""
    for name in ("decode", "train"):
        assert reading_length((REPO / "refdec" / "commands" / f"{name}.py").read_text(encoding="utf-8")) < 200


def test_only_the_routes_package_makes_a_route_and_it_copies_no_module_internals():
    """Case: the kernels route built its modules with cls.__new__ and __dict__.update (sharing the
    model's hooks and copying its training flag as a value), and routes were made in the application
    layer, in stepcost and in the routes themselves, keyed by id in a memo. refdec.routes.on_route is
    the one way onto a route: nothing outside refdec/routes constructs one."""
    makers = {"FastRoute", "GraphedRoute", "KernelRoute", "twin"}
    made = []
    for path in SOURCES:
        if (REPO / "refdec" / "routes") in path.parents:
            text = path.read_text(encoding="utf-8")
            made += [f"{path.relative_to(REPO)}: {bad}" for bad in ("__new__(", "__dict__.update") if bad in text]
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in makers:
                    made.append(f"{path.relative_to(REPO)}:{node.lineno} {name}(")
    assert not made, made


def test_no_command_module_imports_another():
    """Case: ctranslate2 imported stepcost's timing helpers, bench three other commands' modules, and a
    decoder lived in the ceiling command. A command module imports the command table
    (refdec.commands) and the shared harness alone of its package; what commands share lives below."""
    commands = REPO / "refdec" / "commands"
    borrowed = []
    for path in sorted(commands.glob("*.py")):
        if path.name in ("__init__.py", "harness.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                borrowed += [
                    f"{path.name}:{node.lineno} {n}"
                    for n in names
                    if n not in ("harness", "as_typed", "command_main", "COMMANDS")
                ]
    assert not borrowed, borrowed


def layout_names() -> set[str]:
    """The paths docs/layout.md's tree names. An entry line starts, after 4 + 2 x depth spaces, with a
    name or names (comma-separated) ended by two spaces; a name ending in "/" is a folder, and the entries
    one level deeper below it are inside it. A description's further lines are indented further."""
    names, folders = set(), [""]
    for line in (REPO / "docs" / "layout.md").read_text(encoding="utf-8").splitlines():
        entry = re.match(r"( {4}(?:  )*)(\S.*?)(?: {2}|$)", line)
        if not entry or len(entry.group(1)) > 12:
            continue
        depth = (len(entry.group(1)) - 4) // 2
        for name in entry.group(2).split(", "):
            path = folders[depth] + name
            names.add(path)
            if name.endswith("/"):
                folders[depth + 1 :] = [path]
    return names


def test_docs_layout_names_every_module_and_no_module_that_is_gone():
    """Case: docs/layout.md omitted refdec/decoding/ties.py, scripted.py and result.py, and named the
    presets in config.py after they had a module of their own. Every module of refdec/ and both scripts
    have a line in its tree (a package's __init__.py may be described on its folder's line), and every
    .py file the tree names exists."""
    names = layout_names()
    sources = [p.relative_to(REPO).as_posix() for p in SOURCES]
    missing = [
        s
        for s in sources
        if s not in names and not (s.endswith("/__init__.py") and s.removesuffix("__init__.py") in names)
    ]
    assert not missing, missing
    gone = sorted(n for n in names if n.endswith(".py") and not (REPO / n).is_file())
    assert not gone, gone
