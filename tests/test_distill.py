"""Sequence-level distillation: the teacher's outputs become a training folder train.py can read."""

from __future__ import annotations

import json

import pytest

from conftest import run_py
from refdec.data import load_split
from refdec.distill import distill


def test_distilled_folder_holds_teacher_outputs_and_resumes(trained_tiny, tmp_path):
    """Guards against misaligned targets (sorting by length must be undone), a lost resume, and a
    folder train.py cannot use."""
    full = distill("mt-en-de", trained_tiny / "model.pt", tmp_path / "a", algo="greedy", batch_size=8,
                   limit=40, save_every=1, log=lambda m: None)
    assert full["sentences"] == 40
    a = load_split("mt-en-de", "train", tmp_path / "a")
    orig = load_split("mt-en-de", "train")
    assert a.src == orig.src[:40] and len(a.tgt) == 40 and a.docs == orig.docs[:40]
    assert load_split("mt-en-de", "dev", tmp_path / "a").tgt == load_split("mt-en-de", "dev").tgt

    class Stop(Exception):
        pass

    seen = []

    def stop_after_two(msg):
        seen.append(msg)
        if len(seen) == 2:
            raise Stop

    with pytest.raises(Stop):
        distill("mt-en-de", trained_tiny / "model.pt", tmp_path / "b", algo="greedy", batch_size=8, limit=40,
                save_every=1, log=stop_after_two)
    log = []
    distill("mt-en-de", trained_tiny / "model.pt", tmp_path / "b", algo="greedy", batch_size=8, limit=40,
            save_every=1, log=log.append)
    assert log[0].startswith("continuing: 16 of 40")
    assert load_split("mt-en-de", "train", tmp_path / "b").tgt == a.tgt
    assert json.loads((tmp_path / "b" / "mt-en-de" / "distill.json").read_text())["algo"] == "greedy"

    r = run_py("train.py", "--preset", "tiny", "--out-dir", str(tmp_path / "t"), "--data-dir", str(tmp_path / "a"),
               "--max-steps", "2", "--eval-every", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr.decode()


def test_beam_teacher_and_cli(trained_tiny, tmp_path):
    r = run_py("-m", "refdec.distill", "--task", "mt-en-de", "--model", str(trained_tiny / "model.pt"), "--out",
               str(tmp_path / "c"), "--limit", "6", "--beam-size", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["beam_size"] == 2
    assert len(load_split("mt-en-de", "train", tmp_path / "c").tgt) == 6
    bad = run_py("-m", "refdec.distill", "--task", "mt-en-de", "--model", str(tmp_path / "none.pt"), "--out",
                 str(tmp_path / "d"))
    assert bad.returncode == 2 and "not found" in bad.stderr.decode() and b"Traceback" not in bad.stderr
