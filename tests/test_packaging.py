"""The package metadata: `pip install -e .` and `pip install .` make refdec importable anywhere.
Case: `python -m refdec.hf` worked only from the repository's root (ModuleNotFoundError elsewhere):
there was no package metadata, so refdec could not be installed into a user's environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile

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


def test_ci_runs_the_readme_test_command_which_installs_refdec():
    """Guards .ci/run against drifting from the README's test command, which installs the package the
    way the README says before running the tests."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^    (pip install -r requirements\.txt && pip install -e \. && python -m pytest [^\n]*)$",
                        readme, re.M).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.mark.slow
def test_an_installed_copy_runs_from_any_folder_and_ships_no_data(tmp_path):
    """`pip install .` of the repository: a wheel of refdec/ alone, whose commands run from any folder
    (`python -m refdec.hf --help`, ...); a command that reads the repository's checkpoints/ or data/
    by default says in one line that this copy has none and what to do. Built from a copy of the
    sources so that no build files land in the repository."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "refdec", src / "refdec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    run = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "wheel"), str(src)], **run)
    assert r.returncode == 0, r.stderr
    wheel = next((tmp_path / "wheel").glob("refdec-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"refdec", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                        str(wheel)], **run)
    assert r.returncode == 0, r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    for module in ("refdec.hf", "refdec.ctranslate2", "refdec.stepcost", "refdec.ceiling", "refdec.fuzz",
                   "refdec.distill", "refdec.bench", "refdec.train_drafters"):
        r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=elsewhere, env=env, **run)
        assert r.returncode == 0 and "usage:" in r.stdout, (module, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import refdec; print(refdec.__file__)"], cwd=elsewhere, env=env, **run)
    assert r.stdout.startswith(str(tmp_path / "site")), r.stdout
    r = subprocess.run([sys.executable, "-m", "refdec.stepcost", "--task", "gec-uk"], cwd=elsewhere, env=env, **run)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "checkpoints/gec-uk/model.pt is in refdec's repository" in err and "--model" in err
    assert "pip install -e ." in err
    for module in ("refdec.bench", "refdec.train_drafters"):  # the files a copy needs: a clone's
        r = subprocess.run([sys.executable, "-m", module, "--files"], cwd=elsewhere, env=env, **run)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "pip install -e ." in err, (module, err)
