"""decode.py --html and the trace Steps behind it: a well-formed, self-contained page that holds every
sentence and its decoding; --trace coloured in a terminal and plain otherwise."""

from __future__ import annotations

import html
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from conftest import REPO, copy_model, random_src, run_py, tiny_model

from refdec.config import EOS_ID
from refdec.decoding import decode_bild, decode_greedy, decode_iad, decode_speculative
from refdec.decoding.verify import Verified, step_of
from refdec.tokenizer import Tokenizer
from refdec.trace import COLOURS, Step, colour_enabled, strip_colour, trace_text

DECODE = ["decode.py", "--task", "mt-en-de", "--threads", "1", "--quiet", "--warmup", "0"]
LINES = [
    "The file could not be opened.",
    "",
    'Click <b>OK</b> & "close" the dialog.',
    "Hello world.",
    "Is this the right folder?",
]
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class TagBalance(HTMLParser):
    """Every start tag closed by its own end tag, in order (void elements and <x/> need none)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.ids = [], [], []

    def handle_starttag(self, tag, attrs):
        self.ids += [v for k, v in attrs if k == "id"]
        if tag not in VOID:
            self.stack.append((tag, self.getpos()))

    def handle_startendtag(self, tag, attrs):
        self.ids += [v for k, v in attrs if k == "id"]

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1][0] != tag:
            self.errors.append(f"</{tag}> at {self.getpos()} closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()


def check_page(page: str) -> None:
    p = TagBalance()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed: {p.stack[:5]}"
    assert page.startswith("<!DOCTYPE html>")
    assert len(p.ids) == len(set(p.ids)), "an id is used twice (several inline SVGs must not share one)"
    # Self-contained: nothing fetched from elsewhere.
    assert not re.search(r"<script[^>]*\ssrc\s*=", page, re.I)
    assert not re.search(r"<link[\s>]", page, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?\s*(https?:)?//", page, re.I)


def sections(page: str) -> dict[int, str]:
    parts = re.split(r'<section class="sent" id="s(\d+)"', page)[1:]
    return {int(n): body for n, body in zip(parts[::2], parts[1::2])}


def run_block(section: str, run: str) -> str:
    m = re.search(rf'<details class="run" data-run="{re.escape(run)}"[^>]*>(.*?)</details>', section, re.S)
    assert m, f"no {run} block"
    return m.group(1)


@pytest.fixture(scope="module")
def iad_page(trained_tiny, tmp_path_factory):
    """An IAD run beside greedy and beam, with --trace, on lines with an empty one and HTML characters."""
    d = tmp_path_factory.mktemp("html")
    (d / "in.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    (d / "ref.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    r = run_py(
        *DECODE,
        "--model",
        str(trained_tiny / "model.pt"),
        "--algo",
        "iad",
        "--compare",
        "greedy,beam",
        "--input",
        str(d / "in.txt"),
        "--ref",
        str(d / "ref.txt"),
        "--max-len",
        "12",
        "--trace",
        "--html",
        str(d / "page.html"),
    )
    assert r.returncode == 0, r.stderr.decode()
    return d / "page.html", r.stderr.decode(), r.stdout.decode()


@pytest.mark.slow
def test_page_is_well_formed_self_contained_and_holds_every_sentence(iad_page):
    path, err, out = iad_page
    page = path.read_text(encoding="utf-8")
    check_page(page)
    secs = sections(page)
    assert sorted(secs) == list(range(1, len(LINES) + 1))
    for i, line in enumerate(LINES, 1):
        if line:
            assert html.escape(line) in secs[i]
    assert "<b>OK</b>" not in page  # escaped, never markup
    for out_line, i in zip(out.splitlines(), range(1, len(LINES) + 1)):
        assert html.escape(out_line) in secs[i]
    # The summary table's rows, as printed.
    for name in ("iad", "greedy", "beam"):
        assert f"<td>{name}@" in page or f"<td>{name}</td>" in page
    assert page.count("<svg") >= 1  # charts: tokens per call (speedup by edit ratio: GEC only, test_decode_cli)


@pytest.mark.slow
def test_page_draws_each_iteration_of_the_trace(iad_page):
    """The IAD block of each sentence has one row per iteration that --trace printed, and greedy's
    one own token per step: the output's tokens and eos."""
    path, err, _ = iad_page
    secs = sections(path.read_text(encoding="utf-8"))
    printed = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"^\[(\d+)\] (\d+) iterations? for", err, re.M)}
    assert sorted(printed) == [i for i, line in enumerate(LINES, 1) if line]
    for i, n in printed.items():
        block = run_block(secs[i], "iad")
        assert block.count('<div class="it">') == n
        assert 'class="tok own' in block or 'class="tok accepted' in block
        greedy_block = run_block(secs[i], "greedy")
        steps = int(re.search(r"(\d+) iterations?, one token each", greedy_block).group(1))
        assert greedy_block.count('class="tok own') == steps
    assert "<details" not in secs[2] and "(blank line" in secs[2]  # the empty line has no trace


@pytest.mark.slow
def test_html_with_drafter_heads_and_small_model_algorithms(trained_tiny, tiny_extras, tmp_path):
    """GAD's draft/verify lines, BiLD's and speculative decoding's S/L marks, blockwise's heads and
    GAD's time per module."""
    page_path = tmp_path / "p.html"
    r = run_py(
        *DECODE,
        "--model",
        str(trained_tiny / "model.pt"),
        "--algo",
        "gad",
        "--drafter",
        str(tiny_extras["drafter"]),
        "--small",
        str(trained_tiny / "model.pt"),
        "--limit",
        "3",
        "--max-len",
        "10",
        "--compare",
        f"bild,speculative,blockwise@{tiny_extras['heads']},greedy",
        "--html",
        str(page_path),
    )
    assert r.returncode == 0, r.stderr.decode()
    page = page_path.read_text(encoding="utf-8")
    check_page(page)
    secs = sections(page)
    assert sorted(secs) == [1, 2, 3]
    gad_block = run_block(secs[1], "gad@" + trained_tiny.name)
    assert gad_block.count('class="dv">D<') == gad_block.count('class="dv">V<') > 0
    for name in ("bild", "speculative"):
        assert re.search(r'class="who">[SL]<', run_block(secs[1], f"{name}@{trained_tiny.name}"))
    assert "proposed by the heads" in run_block(
        secs[1], f"blockwise@{tiny_extras['heads'].parent.name}"
    ) or "nothing drafted" in run_block(secs[1], f"blockwise@{tiny_extras['heads'].parent.name}")
    assert "verifier decoder" in page  # the module-time chart (SVG text)
    assert '<option value="gad@' in page  # the differs-from-greedy filter names the lossless run


@pytest.mark.slow
def test_html_path_is_checked_before_decoding(trained_tiny, tmp_path):
    r = run_py(
        *DECODE,
        "--model",
        str(trained_tiny / "model.pt"),
        "--algo",
        "greedy",
        "--limit",
        "1",
        "--html",
        str(tmp_path / "missing" / "p.html"),
    )
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and err.startswith("error: --html") and len(err.splitlines()) == 1, err
    r = run_py(
        *DECODE,
        "--model",
        str(trained_tiny / "model.pt"),
        "--algo",
        "greedy",
        "--limit",
        "1",
        "--report",
        str(tmp_path / "same"),
        "--html",
        str(tmp_path / "same"),
    )
    assert r.returncode == 2 and "also the --report" in r.stderr.decode()


@pytest.mark.slow
def test_library_and_decode_import_without_matplotlib():
    """matplotlib is imported only when a page is drawn."""
    code = (
        "import sys, builtins\nreal = builtins.__import__\n"
        "def imp(name, *a, **k):\n    if name.split('.')[0] == 'matplotlib': raise ImportError(name)\n"
        "    return real(name, *a, **k)\nbuiltins.__import__ = imp\n"
        "import refdec.errors, refdec.app.runner, refdec.trace, refdec.app.htmlreport, decode\n"
        "from refdec.commands.decode import build_parser\nbuild_parser()\n"
        "try:\n    refdec.app.htmlreport.check_available()\nexcept refdec.errors.UsageError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused: --html needs matplotlib" in r.stdout


# ---------------------------------------------------------------- Steps and the --trace text


@pytest.fixture(scope="module")
def tokenizer(trained_tiny) -> Tokenizer:
    return Tokenizer.load(trained_tiny / "tokenizer.json")


def output_with_eos(tokens: torch.Tensor, max_len: int) -> list[int]:
    return tokens.tolist() + ([EOS_ID] if len(tokens) < max_len else [])


def test_steps_commit_exactly_the_output():
    """For every algorithm, the Steps' committed tokens, in order, are the output (and its eos); the
    accepted span is the head of the drafted tokens and the rejected ones the rest; IAD's drafted
    tokens are the source span at its origin."""
    m, other = copy_model(), tiny_model(4, vocab=16)
    src = random_src(2, 4, 16, min_len=3, max_len=10)
    ids = [row[row.ne(0)].tolist()[:-1] for row in src]  # without the eos
    runs = {
        "greedy": decode_greedy(m, src, max_len=20, trace=True),
        "iad": decode_iad(m, src, max_len=20, trace=True, max_draft=5),
        "bild": decode_bild(m, other, src, max_len=20, fallback_threshold=0.2, rollback_threshold=1.0, trace=True),
        "speculative": decode_speculative(m, other, src, max_len=20, gamma=3, trace=True),
    }
    seen_rejected = set()
    for algo, r in runs.items():
        for b in range(len(src)):
            steps = r.trace[b]
            assert all(isinstance(s, Step) for s in steps)
            assert [t for s in steps for t in s.committed] == output_with_eos(r.tokens[b], 20), (algo, b)
            for s in steps:
                assert s.drafted[: s.accepted] + s.rejected == s.drafted
                if s.rejected and s.own is not None and algo != "bild":
                    assert s.rejected[0] != s.own  # the bifurcation: the verifier chose another token
                if s.rejected:
                    seen_rejected.add(algo)
                if algo == "iad" and s.drafted:
                    assert s.drafted_by == "source" and s.drafted == tuple(
                        (ids[b] + [EOS_ID])[s.origin :][: len(s.drafted)]
                    )
    assert {"iad", "speculative"} <= seen_rejected  # the cases above do reject drafted tokens


def test_a_step_ending_on_a_drafted_eos_has_no_verifier_token():
    nothing = torch.empty(0)
    s = step_of([7, EOS_ID], Verified([7, EOS_ID], 2, nothing, nothing), "small")
    assert s.own is None and s.committed == (7, EOS_ID) and s.drafted_by == "small"
    s = step_of([7, 8, EOS_ID, 9], Verified([7, 8, EOS_ID], 4, nothing, nothing), "drafter")  # passed past the eos
    assert s.accepted == 3 and s.own is None and s.rejected == (9,)
    s = step_of([], Verified([5], 0, nothing, nothing), "heads")  # nothing drafted: the verifier's token alone
    assert s == Step(own=5)


@pytest.mark.slow
def test_trace_text_colour_is_the_plain_text_painted(tokenizer):
    m = copy_model()
    src = random_src(5, 3, 16, min_len=4, max_len=10)
    r = decode_iad(m, src, max_len=20, trace=True)
    for b in range(3):
        plain = trace_text("iad", b, r.trace[b], tokenizer)
        colour = trace_text("iad", b, r.trace[b], tokenizer, colour=True)
        assert "\x1b[" not in plain and strip_colour(colour) == plain
        assert COLOURS["accepted"] in colour or COLOURS["own"] in colour
    a, b, c, d, x = tokenizer.encode("the house is very red")[:5]
    traces = {  # every format, with accepted, rejected and eos-ended steps
        "gad": [Step((a, b, c, d), 2, x, "drafter"), Step((d, EOS_ID), 2, None, "drafter")],
        "blockwise": [Step(own=a), Step((b, c), 1, x, "heads")],
        "bild": [Step((a, b, c), 1, x, "small", rollback=True), Step((d, EOS_ID), 2, None, "small", verified=False)],
        "speculative": [Step((a, b), 2, c, "small"), Step((d, EOS_ID), 2, None, "small")],
        "greedy": [Step(own=a), Step(own=EOS_ID)],
        "beam": [Step(beams=((a,), (b,)), scores=(-1.0, -2.0))],
    }
    for algo, steps in traces.items():
        plain = trace_text(algo, 0, steps, tokenizer)
        colour = trace_text(algo, 0, steps, tokenizer, colour=True)
        assert "\x1b[" not in plain and strip_colour(colour) == plain, algo
    gad = trace_text("gad", 0, traces["gad"], tokenizer, colour=True)
    assert COLOURS["rejected"] in gad and COLOURS["accepted"] in gad and COLOURS["own"] in gad
    assert "rolled back 2 tokens (" in trace_text("bild", 0, traces["bild"], tokenizer)


def test_colour_enabled_follows_the_terminal_and_no_color(monkeypatch):
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert colour_enabled(Stream(True)) and not colour_enabled(Stream(False))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colour_enabled(Stream(True))


def stderr_through_a_terminal(args: list[str], env: dict) -> str:
    """Run decode.py with stderr on a pseudo-terminal; what it wrote there."""
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", **env},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=300)
    os.close(master)
    assert p.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode("utf-8", errors="replace").replace("\r\n", "\n")


@pytest.mark.slow
def test_trace_is_coloured_in_a_terminal_and_plain_when_piped_or_no_color(trained_tiny):
    args = [
        *DECODE,
        "--model",
        str(trained_tiny / "model.pt"),
        "--algo",
        "iad",
        "--limit",
        "2",
        "--max-len",
        "8",
        "--trace",
    ]
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    piped = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"}
    ).stderr.decode()
    tty = stderr_through_a_terminal(args, {})
    no_color = stderr_through_a_terminal(args, {"NO_COLOR": "1"})
    trace_lines = lambda text: [x for x in text.splitlines() if x.startswith(("[", "  "))]  # noqa: E731
    assert "\x1b[" not in piped and "\x1b[" not in no_color
    assert "\x1b[" in tty
    assert trace_lines(strip_colour(tty)) == trace_lines(piped) == trace_lines(no_color)
    assert trace_lines(piped)


# ---------------------------------------------------------------- the page in a browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the rows of an 8-bit RGB or RGBA PNG, unfiltered (zlib alone)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, colour_type = header[:4]
    assert depth == 8 and colour_type in (2, 6), header
    bpp = 3 if colour_type == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, stride, bpp)]


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(b) for b in BROWSERS), reason="no chromium or chrome on PATH")
def test_page_renders_in_headless_chromium(iad_page, tmp_path):
    """The page paints (text, coloured token chips, charts: many colours, far from blank) and its
    script runs (it writes the sentence count)."""
    path = iad_page[0]
    browser = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'prof'}"]
    shot = tmp_path / "page.png"
    subprocess.run(
        [browser, *flags, "--window-size=1280,1800", f"--screenshot={shot}", path.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists()
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1280, 1800)
    colours = {}
    for p in pixels:
        colours[p] = colours.get(p, 0) + 1
    background = max(colours.values())
    assert len(colours) > 200, f"only {len(colours)} colours"
    assert background < 0.97 * len(pixels), "the page is almost one colour"
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", path.as_uri()], capture_output=True, timeout=120
    ).stdout.decode()
    assert f"{len(LINES)} of {len(LINES)} sentences" in dom


# ---------------------------------------------------------------- charts that do not exaggerate, links that land


def chart_figure(monkeypatch, draw, *args):
    """The matplotlib figure a chart function draws (its SVG step skipped)."""
    from refdec.app import htmlreport

    monkeypatch.setattr(htmlreport, "svg", lambda fig, name, caption: fig)
    return draw(*args)


@pytest.mark.slow
def test_quality_axes_start_at_zero_and_name_the_difference(monkeypatch):
    """Case: the quality chart autoscaled its axis to 89.410-89.435 BLEU and 0.394-0.401 F0.5, so a
    0.02 BLEU difference filled the chart. Both axes now start at 0 and each point beside the first
    carries its difference from the first row."""
    from refdec.app import htmlreport

    rows = [
        {"algo": "iad", "seconds": 10.0, "bleu": 89.41, "gec_f05": 0.3940},
        {"algo": "greedy", "seconds": 40.0, "bleu": 89.43, "gec_f05": 0.4010},
        {"algo": "beam", "seconds": 70.0, "bleu": 89.41, "gec_f05": 0.3940},
    ]
    fig = chart_figure(monkeypatch, htmlreport.chart_quality_speed, rows)
    bleu, f05 = fig.axes
    assert bleu.get_ylim()[0] == 0 and f05.get_ylim()[0] == 0
    assert bleu.get_xlim()[0] == 0 and f05.get_xlim()[0] == 0
    assert bleu.get_ylim()[1] <= 100 and f05.get_ylim()[1] <= 1
    assert {t.get_text() for t in bleu.texts} == {"+0.02", "same"}
    assert {t.get_text() for t in f05.texts} == {"+0.0070", "same"}
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.slow
def test_edit_ratio_chart_and_table_show_one_named_statistic(monkeypatch):
    """Case: the bar of bucket (0.1, 0.2] read 0.65x where the table beside it gave a median of 2.27x
    for the same bucket. The page now shows one statistic, the bucket's total-time speedup, under one
    name in the chart and the table."""
    from refdec.app import htmlreport

    buckets = [
        {"edit_ratio": "0", "sentences": 5, "calls_per_sentence": 1.0, "speedup": 4.1, "median_sentence_speedup": 4.3},
        {
            "edit_ratio": "(0.1, 0.2]",
            "sentences": 3,
            "calls_per_sentence": 5.0,
            "speedup": 0.65,
            "median_sentence_speedup": 2.27,
        },
    ]
    checks = [{"algo": "iad", "greedy": "greedy", "identical": 1.0, "divergences": [], "edit_buckets": buckets}]
    rows = [{"algo": "iad", "seconds": 1.0}, {"algo": "greedy", "seconds": 3.0}]
    table = htmlreport.summary_html(rows, None, checks)
    fig = chart_figure(monkeypatch, htmlreport.chart_edit_buckets, checks)
    ax = fig.axes[0]
    name = htmlreport.bucket_speedup_name("greedy")
    assert ax.get_ylabel() == name and f"<th>{html.escape(name)}</th>" in table
    assert [round(b.get_height(), 2) for b in ax.patches] == [4.1, 0.65]
    assert ax.get_ylim()[0] == 0
    assert "0.65x" in table and "4.10x" in table and "2.27x" not in table and "median" not in table
    assert [t.get_text().split("\n")[0] for t in ax.texts] == ["4.10x", "0.65x"]
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(b) for b in BROWSERS), reason="no chromium or chrome on PATH")
def test_a_link_to_a_sentence_shows_it_in_headless_chromium(iad_page, tmp_path):
    """Case: page.html#s78 screenshotted blank in headless Chromium. The cause is the screenshot, not
    the page: headless --screenshot paints nothing of a scrolled viewport (a plain page of 100
    paragraphs opened at #s78, or scrolled by a script, comes out blank too), while its DOM is
    scrolled to the sentence. So the page is opened at #s4 in a window taller than the page: the
    linked sentence must be marked (and its runs' decodings opened) by the page's script, and be
    painted with its mark; the sticky search bar must not cover it when the browser scrolls."""
    path = iad_page[0]
    browser = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'prof'}"]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", path.as_uri() + "#s4"], capture_output=True, timeout=120
    ).stdout.decode()
    linked = re.findall(r'<section class="sent linked" id="s(\d+)"', dom)
    assert linked == ["4"], linked
    s4 = dom.split('id="s4"')[1].split('<section class="sent')[0]
    assert s4.count("<details") == len(re.findall(r"<details[^>]* open", s4)) == 3  # iad, greedy, beam
    assert "scroll-margin-top" in path.read_text(encoding="utf-8")
    # A search that hides the linked sentence is cleared (the input starts with a query matching nothing).
    hiding = tmp_path / "searched.html"
    hiding.write_text(
        path.read_text(encoding="utf-8").replace('<input id="q" ', '<input id="q" value="zzzqqq" '), encoding="utf-8"
    )
    for fragment, shown in (("#s4", len(LINES)), ("", 0)):
        dom = subprocess.run(
            [browser, *flags, "--dump-dom", hiding.as_uri() + fragment], capture_output=True, timeout=120
        ).stdout.decode()
        assert f"{shown} of {len(LINES)} sentences" in dom, fragment
    mark = bytes((0xF3, 0xD3, 0x6B))  # the linked sentence's outline
    for fragment, marked in (("#s4", True), ("", False)):
        shot = tmp_path / f"page{fragment.strip('#')}.png"
        subprocess.run(
            [browser, *flags, "--window-size=1280,6000", f"--screenshot={shot}", path.as_uri() + fragment],
            capture_output=True,
            timeout=120,
        )
        pixels = png_pixels(shot)[2]
        assert (pixels.count(mark) > 200) == marked, fragment


def test_greedy_and_beam_traces_show_text_not_byte_level_symbols():
    """Case: beam's --trace printed `Ġgibt ĠF lex ib ilitÃ¤t`, the byte-level BPE symbols, where the other
    traces print text. Beam's best beam is now decoded text, and greedy's tokens each their own text."""
    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    ids = tok.encode("Es gibt Flexibilität.")
    beam = trace_text("beam", 0, [Step(beams=(tuple(ids),), scores=(-1.0,))], tok)
    greedy = trace_text("greedy", 0, [Step(own=t) for t in ids + [tok.eos_id]], tok)
    assert beam.endswith("best live beam at the end: Es gibt Flexibilität.")
    assert "Ġ" not in greedy + beam and "Ã" not in greedy + beam
    assert greedy.split(": ", 1)[1].replace("|", "") == "Es gibt Flexibilität. </s>"


def test_the_terminal_trace_and_the_page_say_a_draft_came_from_the_source_alike():
    """Case: --trace said "drafted from source token 3" where the HTML page said "copied from the source"."""
    from refdec.app.htmlreport import steps_html
    from refdec.trace import DRAFTED_FROM, how_drafted, token_pieces

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    a, b, c, x = tok.encode("the house is red")[:4]
    steps = [Step((a, b, c), 2, x, "source", origin=3), Step(own=x)]
    assert how_drafted(steps[0]) == f"3 {DRAFTED_FROM['source']} starting at its token 4, 2 accepted"
    text, page = trace_text("iad", 0, steps, tok), steps_html("iad", steps, token_pieces(tok))
    for step in steps:
        assert how_drafted(step) in text and html.escape(how_drafted(step)) in page
    assert "drafted from source" not in text


def page_words(row: str) -> list[tuple[str, str, list[str]]]:
    """Each word a row of the page draws: (its text, its title, its tokens' parts)."""
    out = []
    for m in re.finditer(
        r'<span class="word"( title="([^"]*)")?>((?:<span class="tok [a-z]+">[^<]*</span>)+)</span>', row
    ):
        toks = re.findall(r'<span class="tok ([a-z]+)">([^<]*)</span>', m.group(3))
        out.append(("".join(html.unescape(t) for _, t in toks), html.unescape(m.group(2) or ""), [p for p, _ in toks]))
    return out


def test_the_page_draws_words_as_the_trace_joins_them():
    """Case: the page drew subword tokens as words on a slide ("unw it ting ly", "sent ence .") where
    --trace joins them. A token that no space leads continues the word before it on the page as in the
    trace (refdec.trace.words): the page's words are the trace's, each token keeps its part's colour,
    and a word's tokens are in its title."""
    from refdec.app.htmlreport import steps_html
    from refdec.trace import token_pieces, words

    tok = Tokenizer.load(REPO / "checkpoints" / "gec-en-9x3" / "tokenizer.json")
    piece = token_pieces(tok)
    ids = tok.encode("He unwittingly wrote a sentence.")
    assert [[piece(ids[i])[0] for i in w] for w in words(ids, piece)] == [
        ["He"],
        ["unw", "it", "ting", "ly"],
        ["wrote"],
        ["a"],
        ["sent", "ence", "."],
    ]
    greedy = [Step(own=t) for t in ids + [tok.eos_id]]
    drawn = page_words(steps_html("greedy", greedy, piece))
    printed = trace_text("greedy", 0, greedy, tok).split(": ", 1)[1].split(" ")
    assert [w for w, _, _ in drawn] == [w.replace("|", "") for w in printed] == tok.decode(ids).split() + ["</s>"]
    assert [t for _, t, _ in drawn] == ["", "unw|it|ting|ly", "", "", "sent|ence|.", ""]
    # one IAD iteration: "He unwit" accepted, "ting" the model's own, "ly" drafted and rejected, all one word
    he, unw, it, ting, ly = ids[:5]
    drawn = page_words(steps_html("iad", [Step((he, unw, it, ly), 3, ting, "source", origin=0)], piece))
    assert drawn == [
        ("He", "", ["accepted"]),
        ("unwittingly", "unw|it|ting|ly", ["accepted", "accepted", "own", "rejected"]),
    ]
    gad = steps_html("gad", [Step((he, unw, it, ly), 3, ting, "drafter")], piece).split('<span class="dv">V</span>')
    assert [w for w, _, _ in page_words(gad[0])] == ["He", "unwitly"] and [w for w, _, _ in page_words(gad[1])] == [
        "He",
        "unwitting",
    ]


def test_the_pages_style_script_and_template_are_package_files():
    """The page's style, script and template are files of refdec/app/assets/ (package data, so that an
    installed copy has them: test_packaging), inlined in every page; none is a string in the code."""
    from refdec.app import htmlreport

    assert not any(hasattr(htmlreport, name) for name in ("STYLE", "SCRIPT", "PAGE"))
    template = htmlreport.asset("report.html")
    assert all(f"{{{k}}}" in template for k in ("title", "style", "script", "body")) and template.startswith(
        "<!DOCTYPE html>"
    )
    assert ".word .tok + .tok" in htmlreport.asset("report.css")
    assert "getElementById('q')" in htmlreport.asset("report.js")
