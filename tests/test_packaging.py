"""The package metadata: `pip install -e .` and `pip install .` make refdec importable anywhere.
Case: `python -m refdec hf` worked only from the repository's root (ModuleNotFoundError elsewhere):
there was no package metadata, so refdec could not be installed into a user's environment."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_pyproject_installs_refdec_alone_on_the_pinned_torch():
    """Guards the metadata: the package refdec and its subpackages only (no data/, checkpoints/,
    tests/ or scripts), its version from refdec.__version__, and dependencies that the pinned CPU
    torch of requirements.txt satisfies as it is (a pin there, a range here: installing refdec never
    replaces that torch with another build)."""
    from packaging.requirements import Requirement

    import refdec

    meta = pyproject()
    project = meta["project"]
    assert project["name"] == "refdec" and project["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "refdec.__version__"} and refdec.__version__
    assert meta["tool"]["setuptools"]["packages"]["find"]["include"] == ["refdec", "refdec.*"]
    deps = {Requirement(d).name: Requirement(d) for d in project["dependencies"]}
    assert set(deps) == {"torch", "numpy", "tokenizers", "sacrebleu"}
    pinned = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert deps["torch"].specifier.contains(pinned) and not deps["torch"].url
    assert "index-url" not in (REPO / "pyproject.toml").read_text()


def test_the_html_pages_files_are_package_data():
    """The HTML page's style, script and template (refdec/app/assets/) are declared package data, so that
    `pip install .` installs them with refdec.app (the installed-copy test writes a page with them)."""
    from fnmatch import fnmatch

    patterns = pyproject()["tool"]["setuptools"]["package-data"]["refdec.app"]
    assets = sorted(
        p.relative_to(REPO / "refdec" / "app").as_posix() for p in (REPO / "refdec" / "app" / "assets").iterdir()
    )
    assert assets == ["assets/report.css", "assets/report.html", "assets/report.js"]
    assert all(any(fnmatch(a, pat) for pat in patterns) for a in assets), (assets, patterns)


def test_ci_runs_the_readme_test_command_which_installs_refdec():
    """Guards .ci/run against drifting from the README's test command, which installs the package the
    way the README says, then runs the linter and the formatter's check (ruff, pinned in
    requirements.txt) before the tests."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = re.search(
        r"^    (pip install -r requirements\.txt && pip install -e \. && ruff check && ruff format --check "
        r"&& python -m pytest [^\n]*)$",
        readme,
        re.M,
    ).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
    assert re.search(r"^ruff==\S+$", (REPO / "requirements.txt").read_text(), re.M)


def test_install_hints_name_the_extra_and_a_command_that_works_where_they_are_read(tmp_path, monkeypatch):
    """Case: `--html needs matplotlib (pip install -r requirements.txt)` and the transformers and
    safetensors hints sent a user who had run `pip install .` to a file they do not have. Each optional
    feature is an extra of pyproject.toml (refdec.repo.EXTRAS, the same names), and a hint names
    `pip install "refdec[EXTRA]"` where refdec is installed, adds the clone's requirements.txt (relative to
    the current folder inside the clone, else its full path) in a clone, and names the packages where neither holds."""
    import importlib.metadata

    from packaging.requirements import Requirement

    from refdec import repo

    extras = {
        name: {Requirement(r).name for r in reqs}
        for name, reqs in pyproject()["project"]["optional-dependencies"].items()
        if name != "test"
    }
    assert extras == {name: set(packages) for name, packages in repo.EXTRAS.items()}
    # installed (pip install -e .), whether or not this machine's refdec is: the test reads the code alone
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object())
    monkeypatch.chdir(REPO)
    assert repo.install_hint("html") == 'pip install "refdec[html]", or in this clone pip install -r requirements.txt'
    monkeypatch.chdir(tmp_path)  # elsewhere: the clone's file by its full path
    assert repo.install_hint("hf").endswith(f"in this clone pip install -r {REPO / 'requirements.txt'}")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)  # run from a clone, never installed
    assert repo.install_hint("hf") == f"in this clone pip install -r {REPO / 'requirements.txt'}"
    monkeypatch.setattr(repo, "REPO", tmp_path)  # a copied refdec/ folder: no clone around it
    assert repo.install_hint("hf") == "pip install transformers sentencepiece"
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object())
    monkeypatch.setattr(repo, "REPO", tmp_path)  # `pip install .`: site-packages, no requirements.txt
    assert repo.install_hint("html") == 'pip install "refdec[html]"'
    # no message of refdec's sends a user to requirements.txt but through install_hint
    sources = [p for p in (REPO / "refdec").rglob("*.py") if p.name != "repo.py"]
    assert not [p for p in sources if "pip install -r requirements.txt" in p.read_text(encoding="utf-8")]


def see_this_environment(python: Path) -> None:
    """Let the virtual environment of `python` import what this interpreter imports (torch, pip, ...),
    after its own packages. Case: run from a user's own virtual environment, `--system-site-packages`
    reached the base interpreter's packages, which hold no torch, not the user's environment's. A .pth
    file naming this interpreter's package folders reaches them wherever this interpreter is."""
    folders = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    own = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(own) / "this-environment.pth").write_text("\n".join(folders) + "\n", encoding="utf-8")


def test_the_installed_copys_environment_reaches_this_ones_packages(tmp_path):
    """The environment the installed-copy test builds imports torch from this interpreter's packages, in a
    virtual environment or not, and its own packages come first."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    see_this_environment(python)
    r = subprocess.run(
        [
            str(python),
            "-c",
            "import site, sys, torch; from pathlib import Path\n"
            "home = str(Path(torch.__file__).parent.parent)\n"
            "print(home, sys.path.index(site.getsitepackages()[0]) < sys.path.index(home))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    home, own_first = r.stdout.split()
    assert not home.startswith(str(venv)) and own_first == "True", r.stdout


@pytest.mark.slow
def test_an_installed_copy_runs_from_any_folder_and_ships_no_data(tmp_path, trained_tiny):
    """`pip install .` of the repository into a fresh virtual environment: a wheel of refdec/ alone
    with the `refdec` command, whose commands run from any folder (`refdec --help`, `refdec decode
    --help`, ...) and decode with a user's own checkpoint; a command that reads the repository's
    checkpoints/ or data/ by default says in one line that this copy has none and what to do.
    Case: after `pip install .` there was no command to decode with at all (decode.py lived only in a
    clone). Built from a copy of the sources so that no build files land in the repository; the
    environment sees the system's packages (torch) and installs nothing from the network."""
    from refdec.commands import COMMANDS

    src = tmp_path / "src"
    shutil.copytree(REPO / "refdec", src / "refdec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    run = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(src),
        ],
        **run,
    )
    assert r.returncode == 0, r.stderr
    wheel = next((tmp_path / "wheel").glob("refdec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"refdec", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    assert {f"refdec/app/assets/report.{x}" for x in ("css", "js", "html")} <= set(names), names
    venv = tmp_path / "venv"
    # without a pip and setuptools of its own: the system's run there (the pinned torch asks for a newer
    # setuptools than a venv's own, which pip would fetch from the network)
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], **run)
    assert r.returncode == 0, r.stderr
    python, refdec = venv / "bin" / "python", venv / "bin" / "refdec"
    see_this_environment(python)
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], **run)
    assert r.returncode == 0, r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)

    def in_elsewhere(*argv, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=elsewhere, env=env, input=stdin, **run)

    r = in_elsewhere(python, "-c", "import refdec; print(refdec.__file__)")
    assert r.stdout.startswith(str(venv)), r.stdout
    r = in_elsewhere(refdec, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: refdec <command>"), r.stderr
    assert all(f"  {name} " in r.stdout for name in COMMANDS), r.stdout
    for name in COMMANDS:
        r = in_elsewhere(refdec, name, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: refdec {name}"), (name, r.stderr)
    r = in_elsewhere(python, "-m", "refdec", "decode", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m refdec decode"), r.stderr
    (elsewhere / "in.txt").write_text("Das ist gut.\nIch gehe nach Hause.\n", encoding="utf-8")
    r = in_elsewhere(
        refdec,
        "decode",
        "--model",
        trained_tiny / "model.pt",
        "--input",
        "in.txt",
        "--output",
        "out.txt",
        "--threads",
        "1",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert len((elsewhere / "out.txt").read_text(encoding="utf-8").splitlines()) == 2
    r = in_elsewhere(
        refdec,
        "decode",
        "--model",
        trained_tiny / "model.pt",
        "--input",
        "-",
        "--threads",
        "1",
        "--quiet",
        stdin="Das ist gut.\n",
    )
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr
    # the HTML page, its style, script and template read from the installed package's files
    r = in_elsewhere(
        refdec,
        "decode",
        "--model",
        trained_tiny / "model.pt",
        "--input",
        "in.txt",
        "--output",
        "out2.txt",
        "--threads",
        "1",
        "--quiet",
        "--html",
        "page.html",
    )
    assert r.returncode == 0, r.stderr
    page = (elsewhere / "page.html").read_text(encoding="utf-8")
    assets = venv.glob("lib/python*/site-packages/refdec/app/assets/report.css")
    assert page.startswith("<!DOCTYPE html>") and next(assets).read_text(encoding="utf-8") in page
    assert page.count('<section class="sent"') == 2 and '<span class="word"' in page
    for argv, needle in (
        (["stepcost", "--task", "gec-uk"], "checkpoints/gec-uk/model.pt is in refdec's repository"),
        (["decode", "--task", "mt-en-de"], "checkpoints/mt-en-de/model.pt is in refdec's repository"),
        (
            ["decode", "--task", "mt-en-de", "--model", trained_tiny / "model.pt"],
            "data/mt-en-de/test.src.gz is in refdec's repository",
        ),
        (
            [
                "decode",
                "--algo",
                "bild",
                "--model",
                trained_tiny / "model.pt",
                "--task",
                "mt-en-de",
                "--input",
                "in.txt",
            ],
            "checkpoints/mt-en-de-small-aligned/model.pt is in refdec's repository",
        ),
        (["train", "--preset", "tiny", "--out-dir", "run"], "is in refdec's repository"),
        (["bench", "--files"], "pip install -e ."),
        (["train-drafters", "--files"], "pip install -e ."),
    ):
        r = in_elsewhere(refdec, *argv)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert needle in err, (argv, err)
    # an optional feature's hint names the extra, and that command works here: pip keeps this refdec
    # and finds what the extra names (here already installed: --no-index, nothing fetched)
    r = in_elsewhere(
        python,
        "-c",
        "import sys; sys.modules['matplotlib'] = None\n"
        "from refdec.app.htmlreport import check_available\ncheck_available()",
    )
    assert 'needs matplotlib (pip install "refdec[html]")' in r.stderr and "requirements" not in r.stderr, r.stderr
    r = in_elsewhere(python, "-m", "pip", "install", "--dry-run", "--no-index", "refdec[html]")
    assert r.returncode == 0 and "Would install" not in r.stdout, r.stdout + r.stderr
    r = in_elsewhere(refdec, "decodee")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: refdec: no command 'decodee'; choose from {', '.join(COMMANDS)} (refdec --help)"
    ], r.stderr
    r = subprocess.run([sys.executable, "-m", "refdec", "bench", "--files"], cwd=REPO, env=env, **run)
    assert r.returncode == 0 and "refdec/commands/bench.py" in r.stdout.split(), r.stderr
