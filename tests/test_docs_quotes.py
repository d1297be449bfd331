"""The code the docs quote against the files they name, so that a quote cannot drift from the code.
Case: docs/algorithms.md quoted 7 lines that were no longer in the files it named (greedy's
`logits[:, -1].argmax(dim=-1)` where the code reads `argmax(logits[:, -1])`, the tie rule the
exactness argument rests on) and named functions that do not exist (`beam_search`).

The convention the pages follow, which `quotes` reads:

- a name: `path.py:name` or `path.py:Class.name`, a function, class or assignment of that file;
- a table column headed ``line in `path.py:name` `` (or ``line in `path.py` ``): every code span in that
  column is a piece of one line of that file;
- a fenced code block whose first line is a comment `# path.py` (or `# path.py:name`): every other line
  of the block is a line of that file, leading whitespace aside.

`path.py` is a path from the repository's root (`refdec/decoding/verify.py`) or the name of the one
file of refdec/ with that name (`verify.py`). A quoted piece of a line may elide with `...`: the parts
around it are found in that order on one line. On docs/algorithms.md, which quotes the code most,
every other code span that is a bare snake_case name (`decode_beam`, `accept_row`) must also be a
name in refdec/ or tests/ (other pages name other libraries' functions too). The README and every
page of docs/ are read; well under a second.

The decoders quote their papers the same way: each decoder's module docstring numbers its
pseudo-code (`N: ...` at the start of a line, 1, 2, .. in order, as the paper numbers its algorithm
where it does), and every "line N" or "lines N-M" in refdec/decoding/ (code, comments, docstrings)
must name lines that its own module's pseudo-code has.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]  # the pages read
NAMED = ["docs/algorithms.md"]  # ... and those whose every bare snake_case name is refdec's or a test's
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
NAME = re.compile(r"^([\w/]+\.py):([A-Za-z_][\w.]*)$")
SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")


@dataclass(frozen=True)
class Quote:
    page: str
    line: int  # in the page, from 1
    path: str  # as the page names it
    kind: str  # "name", "line" (a piece of one line, `...` eliding) or "block" (a whole line)
    text: str


def resolve(root: Path, path: str) -> Path | None:
    """`refdec/x/y.py` from the root, or `y.py`: the one file of refdec/ with that name."""
    if "/" in path:
        return root / path if (root / path).is_file() else None
    found = [p for p in (root / "refdec").rglob(path) if "__pycache__" not in p.parts]
    return found[0] if len(found) == 1 else None


def quotes(page: str, text: str) -> list[Quote]:
    """Every name, table cell and block line of one page that quotes a file, by the convention above."""
    out: list[Quote] = []
    lines = text.splitlines()
    column, table_path = None, None  # the quoting column of the table being read, and its file
    fence_path, in_fence, first = None, False, False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_fence, fence_path, first = not in_fence, None, not in_fence
            continue
        if in_fence:
            m = re.match(r"^#\s+([\w/]+\.py)(?::([\w.]+))?$", line.strip())
            if first and m:
                fence_path = m.group(1)
                if m.group(2):
                    out.append(Quote(page, n, fence_path, "name", m.group(2)))
            elif fence_path and line.strip() and line.strip() != "...":
                out.append(Quote(page, n, fence_path, "block", line.strip()))
            first = False
            continue
        for span in SPAN.findall(line):
            m = NAME.match(span)
            if m:
                out.append(Quote(page, n, m.group(1), "name", m.group(2)))
        if not line.startswith("|"):
            column = table_path = None
            continue
        cells = split_row(line)
        if column is None and table_path is None:  # a table's header
            for i, cell in enumerate(cells):
                m = re.search(r"\bline in `([\w/]+\.py)(?::[\w.]+)?`", cell)
                if m:
                    column, table_path = i, m.group(1)
            if table_path is None:
                table_path = ""  # a table that quotes nothing
            continue
        if table_path and column is not None and column < len(cells) and not set(cells[column]) <= set("-: "):
            for span in SPAN.findall(cells[column]):
                if not NAME.match(span):
                    out.append(Quote(page, n, table_path, "line", span))
    return out


def split_row(line: str) -> list[str]:
    """A table row's cells where a code span holds a | (written \\|)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def defined(tree: ast.Module, name: str) -> bool:
    """Whether `name` (or `Class.name`) is a function, class or assignment of a module."""
    body = tree.body
    for part in name.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in node.targets):
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == part:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def on_one_line(quote: str, file_lines: list[str]) -> bool:
    """The quote, its `...` the elided text, found in that order on one line of the file."""
    parts = [p.strip() for p in quote.split("...")]
    for line in file_lines:
        at = 0
        for part in parts:
            at = line.find(part, at)
            if at < 0:
                break
            at += len(part)
        else:
            return True
    return False


def known_names(root: Path) -> set[str]:
    words: set[str] = set()
    for folder in ("refdec", "tests"):
        for p in (root / folder).rglob("*.py"):
            if p.name == Path(__file__).name:  # this file names what must not be there
                continue
            words |= set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", p.read_text(encoding="utf-8")))
    return words


def problems(root: Path, pages: list[str] = PAGES, named: list[str] = NAMED) -> list[str]:
    """What the pages quote that their files do not hold, one line each (page:line: what)."""
    out = []
    names = known_names(root)
    for page in pages:
        text = (root / page).read_text(encoding="utf-8")
        for q in quotes(page, text):
            path = resolve(root, q.path)
            where = f"{q.page}:{q.line}"
            if path is None:
                out.append(f"{where}: no file {q.path} (or more than one)")
                continue
            source = path.read_text(encoding="utf-8")
            if q.kind == "name":
                if not defined(ast.parse(source), q.text):
                    out.append(f"{where}: {q.path} defines no {q.text}")
            elif q.kind == "block":
                if q.text not in {line.strip() for line in source.splitlines()}:
                    out.append(f"{where}: no line of {q.path} reads {q.text!r}")
            elif not on_one_line(q.text, source.splitlines()):
                out.append(f"{where}: no line of {q.path} holds {q.text!r}")
        in_fence = False
        for n, line in enumerate(text.splitlines() if page in named else [], 1):
            in_fence ^= line.startswith("```")
            if not in_fence:
                out += [
                    f"{page}:{n}: no name {s} in refdec/ or tests/"
                    for s in SPAN.findall(line)
                    if SNAKE.match(s) and s not in names
                ]
    return out


def test_every_quote_of_the_docs_is_in_the_file_it_names():
    found = problems(REPO)
    assert not found, "\n".join(found)


def test_the_pages_quote_code_by_the_convention():
    """The convention is followed, not only checked: algorithms.md quotes lines in tables and blocks
    of each kind, and names through `path.py:name`."""
    qs = quotes("docs/algorithms.md", (REPO / "docs" / "algorithms.md").read_text(encoding="utf-8"))
    kinds = {k: [q for q in qs if q.kind == k] for k in ("name", "line", "block")}
    assert len(kinds["line"]) >= 30 and len(kinds["block"]) >= 2 and len(kinds["name"]) >= 30, {
        k: len(v) for k, v in kinds.items()
    }
    assert any(q.path.endswith("greedy.py") and q.text == "next_tok = argmax(logits[:, -1])" for q in qs)


def test_a_changed_quoted_line_is_reported(tmp_path):
    """The checker on a copy of the repository's docs and code: each kind of quote, changed in the code,
    is reported at its page's line, and nothing else is."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "refdec", root / "refdec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "docs").mkdir()
    shutil.copy(REPO / "docs" / "algorithms.md", root / "docs" / "algorithms.md")
    pages = ["docs/algorithms.md"]
    assert problems(root, pages) == []
    page = (root / "docs" / "algorithms.md").read_text(encoding="utf-8").splitlines()

    def line_of(text: str) -> int:
        return next(n for n, line in enumerate(page, 1) if text in line)

    changes = [  # file, the line as it is, as changed, a quote of it on the page
        (
            "refdec/decoding/greedy.py",
            "next_tok = argmax(logits[:, -1])",
            "next_tok = logits[:, -1].argmax(dim=-1)",
            "`next_tok = argmax(logits[:, -1])`",
        ),
        (
            "refdec/decoding/verify.py",
            "passed = [d == p for d, p in zip(draft, argmax)]",
            "passed = [d == p for d, p in zip(draft, argmax[1:])]",
            "`passed = [d == p for d, p in zip(draft, argmax)]`",
        ),
        ("refdec/decoding/beam.py", "def decode_beam(", "def beam_search(", "`refdec/decoding/beam.py:decode_beam`"),
    ]
    for path, old, new, quoted in changes:
        code = (root / path).read_text(encoding="utf-8")
        assert code.count(old) == 1, old
        (root / path).write_text(code.replace(old, new), encoding="utf-8")
        found = problems(root, pages)
        assert found and all(f" {path} " in f for f in found), found  # the changed file's quotes, no other
        assert any(f.startswith(f"docs/algorithms.md:{line_of(quoted)}:") for f in found), found
        (root / path).write_text(code, encoding="utf-8")
    assert problems(root, pages) == []
    # a block line: the drafter's cache, quoted whole
    block = next(q for q in quotes("docs/algorithms.md", "\n".join(page)) if q.kind == "block")
    source = resolve(root, block.path)
    code = source.read_text(encoding="utf-8")
    source.write_text(code.replace(block.text, block.text.replace("(", "( ", 1), 1), encoding="utf-8")
    assert problems(root, pages) == [f"docs/algorithms.md:{block.line}: no line of {block.path} reads {block.text!r}"]
    source.write_text(code, encoding="utf-8")
    # a name the page quotes bare, gone from the code
    (root / "docs" / "algorithms.md").write_text("\n".join(page + ["", "See `beam_search`."]) + "\n", encoding="utf-8")
    assert problems(root, pages) == [f"docs/algorithms.md:{len(page) + 2}: no name beam_search in refdec/ or tests/"]


# -- the decoders' line references ---------------------------------------------------------------------------
DECODERS = ["greedy.py", "iad.py", "gad.py", "blockwise.py", "bild.py", "speculative.py"]  # with numbered pseudo-code
LINE_REF = re.compile(r"\b[Ll]ines? (\d+)(?:-(\d+))?")
NUMBERED = re.compile(r"^ *(\d+): ", re.M)


def numbered_lines(source: str) -> list[int]:
    """The numbers of a module's pseudo-code: the lines of its docstring that begin `N: `."""
    return [int(n) for n in NUMBERED.findall(ast.get_docstring(ast.parse(source)) or "")]


def line_reference_problems(name: str, source: str) -> list[str]:
    """Every "line N" / "lines N-M" of a module that names a line its docstring's pseudo-code lacks, and
    pseudo-code not numbered 1, 2, .. in order; one line each (name:line: what)."""
    numbered = numbered_lines(source)
    out = [] if numbered == list(range(1, len(numbered) + 1)) else [f"{name}: pseudo-code numbered {numbered}"]
    for n, line in enumerate(source.splitlines(), 1):
        for m in LINE_REF.finditer(line):
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            if not (first <= last and first in numbered and last in numbered):
                out.append(f"{name}:{n}: {m.group(0)!r} is not a line of the docstring's pseudo-code {numbered}")
    return out


def test_every_line_reference_of_a_decoder_is_a_line_of_its_pseudo_code():
    found = []
    for path in sorted((REPO / "refdec" / "decoding").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        found += line_reference_problems(f"refdec/decoding/{path.name}", source)
        if path.name in DECODERS and not numbered_lines(source):
            found.append(f"refdec/decoding/{path.name}: its docstring numbers no pseudo-code")
    assert not found, "\n".join(found)


def test_a_line_reference_past_the_pseudo_code_is_reported():
    source = '"""Doc.\n\n    1: a\n    2: b\n"""\n\nx = 1  # line 2\ny = 2  # lines 2-3\nz = 3  # Lines 0-1\n'
    assert line_reference_problems("m.py", source) == [
        "m.py:8: 'lines 2-3' is not a line of the docstring's pseudo-code [1, 2]",
        "m.py:9: 'Lines 0-1' is not a line of the docstring's pseudo-code [1, 2]",
    ]
    assert line_reference_problems("m.py", source.replace("    2: b", "    3: b")) == [
        "m.py: pseudo-code numbered [1, 3]",
        "m.py:7: 'line 2' is not a line of the docstring's pseudo-code [1, 3]",
        "m.py:8: 'lines 2-3' is not a line of the docstring's pseudo-code [1, 3]",
        "m.py:9: 'Lines 0-1' is not a line of the docstring's pseudo-code [1, 3]",
    ]
