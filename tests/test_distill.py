"""Sequence-level distillation: the teacher's outputs become a training folder train.py can read."""

from __future__ import annotations

import json

import pytest
from conftest import run_py

from refdec.commands.distill import distill, write_gz
from refdec.data import load_split

pytestmark = pytest.mark.slow  # every test trains a tiny model and runs the distill command


class Stop(Exception):
    pass


def stop_every(n):
    """A log function that stops the run (raises Stop) at every n-th message: the progress line
    that follows a save."""
    seen = []

    def log(msg):
        seen.append(msg)
        if len(seen) % n == 0:
            raise Stop

    return log


def test_distilled_folder_holds_teacher_outputs_and_resumes(trained_tiny, tmp_path):
    """Guards against misaligned targets (sorting by length must be undone), a lost resume, and a
    folder train.py cannot use."""
    full = distill(
        "mt-en-de",
        trained_tiny / "model.pt",
        tmp_path / "a",
        algo="greedy",
        batch_size=8,
        limit=40,
        save_every=1,
        log=lambda m: None,
    )
    assert full["sentences"] == 40
    a = load_split("mt-en-de", "train", tmp_path / "a")
    orig = load_split("mt-en-de", "train")
    assert a.src == orig.src[:40] and len(a.tgt) == 40 and a.docs == orig.docs[:40]
    assert load_split("mt-en-de", "dev", tmp_path / "a").tgt == load_split("mt-en-de", "dev").tgt

    with pytest.raises(Stop):
        distill(
            "mt-en-de",
            trained_tiny / "model.pt",
            tmp_path / "b",
            algo="greedy",
            batch_size=8,
            limit=40,
            save_every=1,
            log=stop_every(2),
        )
    log = []
    distill(
        "mt-en-de",
        trained_tiny / "model.pt",
        tmp_path / "b",
        algo="greedy",
        batch_size=8,
        limit=40,
        save_every=1,
        log=log.append,
    )
    assert log[0].startswith("continuing: 16 of 40")
    assert load_split("mt-en-de", "train", tmp_path / "b").tgt == a.tgt
    assert json.loads((tmp_path / "b" / "mt-en-de" / "distill.json").read_text())["algo"] == "greedy"

    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--out-dir",
        str(tmp_path / "t"),
        "--data-dir",
        str(tmp_path / "a"),
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()


def test_beam_teacher_and_cli(trained_tiny, tmp_path):
    r = run_py(
        "-m",
        "refdec",
        "distill",
        "--task",
        "mt-en-de",
        "--model",
        str(trained_tiny / "model.pt"),
        "--out",
        str(tmp_path / "c"),
        "--limit",
        "6",
        "--beam-size",
        "2",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["beam_size"] == 2
    assert len(load_split("mt-en-de", "train", tmp_path / "c").tgt) == 6
    bad = run_py(
        "-m",
        "refdec",
        "distill",
        "--task",
        "mt-en-de",
        "--model",
        str(tmp_path / "none.pt"),
        "--out",
        str(tmp_path / "d"),
    )
    assert bad.returncode == 2 and "not found" in bad.stderr.decode() and b"Traceback" not in bad.stderr


def write_sources(folder, lines, docs=None):
    folder.mkdir(parents=True, exist_ok=True)
    write_gz(folder / "mono.src.gz", lines)
    if docs is not None:
        write_gz(folder / "mono.doc.gz", docs)
    return folder / "mono.src.gz"


MONO = [
    f"The {w} command reads {n} files from the standard input."
    for n in range(4)
    for w in ("ls", "cat", "sort", "head", "tail", "grep", "sed")
] + ["", "Use the option."]


def train_bytes(folder):
    return {f.name: f.read_bytes() for f in sorted((folder / "mt-en-de").glob("*.gz"))}


def test_sources_resume_gives_the_bytes_of_one_run(trained_tiny, tmp_path):
    """Guards against monolingual sources that lose their order or document ids, and against a
    resumed run (stopped after a save, or with its last line cut off by a kill) whose batches differ
    from an uninterrupted run's and so its outputs."""
    docs = [f"man/1/page{i // 5}" for i in range(len(MONO))]
    sources = write_sources(tmp_path / "mono", MONO, docs)
    model = trained_tiny / "model.pt"
    full = distill(
        "mt-en-de",
        model,
        tmp_path / "a",
        algo="greedy",
        batch_size=4,
        save_every=1,
        sources=sources,
        log=lambda m: None,
    )
    assert full["sources_sha256"] and "identical_to_reference" not in full and full["sentences"] == len(MONO)
    a = load_split("mt-en-de", "train", tmp_path / "a")
    assert a.src == MONO and a.docs == docs and len(a.tgt) == len(MONO) and a.tgt[MONO.index("")] == ""
    assert load_split("mt-en-de", "test", tmp_path / "a").src == load_split("mt-en-de", "test").src

    stop_at_third = stop_every(3)
    with pytest.raises(Stop):
        distill(
            "mt-en-de",
            model,
            tmp_path / "b",
            algo="greedy",
            batch_size=4,
            save_every=1,
            sources=sources,
            log=stop_at_third,
        )
    partial = tmp_path / "b" / "mt-en-de" / ".partial.jsonl"
    saved = partial.read_text(encoding="utf-8")
    partial.write_text(saved[:-7], encoding="utf-8")  # the last record cut off mid-line, as by a kill
    with pytest.raises(Stop):  # stopped again after one more batch
        distill(
            "mt-en-de",
            model,
            tmp_path / "b",
            algo="greedy",
            batch_size=4,
            save_every=1,
            sources=sources,
            log=stop_at_third,
        )
    lines = partial.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 + 11 + 4 + 4 and all(json.loads(line) for line in lines)  # batch 3 again, batch 4
    log = []
    distill(
        "mt-en-de", model, tmp_path / "b", algo="greedy", batch_size=4, save_every=1, sources=sources, log=log.append
    )
    assert log[0].startswith(f"continuing: 16 of {len(MONO)}")
    assert train_bytes(tmp_path / "b") == train_bytes(tmp_path / "a")
    assert not partial.exists()

    # other sources make the saved work stale: it is thrown away, not mixed in
    other = write_sources(tmp_path / "other", MONO[::-1])
    distill(
        "mt-en-de", model, tmp_path / "c", algo="greedy", batch_size=4, sources=sources, limit=8, log=lambda m: None
    )
    (tmp_path / "c" / "mt-en-de" / ".partial.jsonl").write_text(saved, encoding="utf-8")
    log = []
    distill("mt-en-de", model, tmp_path / "c", algo="greedy", batch_size=4, sources=other, log=log.append)
    assert not log[0].startswith("continuing")
    distill("mt-en-de", model, tmp_path / "d", algo="greedy", batch_size=4, sources=other, log=lambda m: None)
    assert train_bytes(tmp_path / "c") == train_bytes(tmp_path / "d")
    c = load_split("mt-en-de", "train", tmp_path / "c")
    assert c.src == MONO[::-1] and c.docs == [""] * len(MONO)
    assert not (tmp_path / "c" / "mt-en-de" / "train.doc.gz").exists()


def test_add_puts_a_distilled_folder_first_and_checks_its_teacher(trained_tiny, tmp_path):
    """Guards against monolingual pairs added to a folder of another teacher or decoding, and against
    the added pairs losing their targets or documents."""
    model = trained_tiny / "model.pt"
    base = distill("mt-en-de", model, tmp_path / "base", algo="greedy", batch_size=8, limit=10, log=lambda m: None)
    sources = write_sources(tmp_path / "mono", MONO[:6])
    r = run_py(
        "-m",
        "refdec",
        "distill",
        "--task",
        "mt-en-de",
        "--model",
        str(model),
        "--algo",
        "greedy",
        "--sources",
        str(sources),
        "--add",
        str(tmp_path / "base"),
        "--out",
        str(tmp_path / "m"),
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(r.stdout)
    assert report["added_pairs"] == base["sentences"] == 10 and report["pairs"] == 16
    b = load_split("mt-en-de", "train", tmp_path / "base")
    m = load_split("mt-en-de", "train", tmp_path / "m")
    assert m.src == b.src + MONO[:6] and m.tgt[:10] == b.tgt
    assert m.docs == b.docs + [f"mono.src.gz/{i}" for i in range(1, 7)]

    bad = run_py(
        "-m",
        "refdec",
        "distill",
        "--task",
        "mt-en-de",
        "--model",
        str(model),
        "--beam-size",
        "2",
        "--sources",
        str(sources),
        "--add",
        str(tmp_path / "base"),
        "--out",
        str(tmp_path / "x"),
    )
    assert bad.returncode == 2 and "algo" in bad.stderr.decode() and b"Traceback" not in bad.stderr


def test_torchrun_ranks_give_the_bytes_of_one_process_and_resume_per_rank(trained_tiny, tmp_path):
    """Guards distillation across processes: 2 ranks (torchrun, gloo) write the bytes of a one-process
    run, and a rank's saved work (its own partial file) is not decoded again."""
    import socket

    from refdec.tokenizer import Tokenizer

    model = trained_tiny / "model.pt"
    one = distill("mt-en-de", model, tmp_path / "one", algo="greedy", batch_size=8, limit=40, log=lambda m: None)

    def torchrun(out):
        with socket.socket() as sock:  # a free port, so a parallel run cannot collide
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        r = run_py(
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            port,
            "-m",
            "refdec",
            "distill",
            "--task",
            "mt-en-de",
            "--model",
            str(model),
            "--algo",
            "greedy",
            "--batch-size",
            "8",
            "--limit",
            "40",
            "--save-every",
            "1",
            "--out",
            str(out),
            timeout=600,
        )
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        return r.stderr.decode()

    torchrun(tmp_path / "two")
    assert train_bytes(tmp_path / "two") == train_bytes(tmp_path / "one")
    assert not list((tmp_path / "two" / "mt-en-de").glob(".partial*"))

    # rank 1's batches (every second batch of the length-sorted sources) saved by an earlier run
    tok = Tokenizer.load(trained_tiny / "tokenizer.json")
    ids = tok.encode_batch(load_split("mt-en-de", "train").src[:40])
    order = sorted((i for i in range(40) if ids[i]), key=lambda i: len(ids[i]))
    rank1 = [i for b in range(1, 5, 2) for i in order[8 * b : 8 * b + 8]]
    folder = tmp_path / "resumed" / "mt-en-de"
    folder.mkdir(parents=True)
    header = {k: one[k] for k in ("teacher", "teacher_sha256", "algo", "beam_size", "sentences")}
    (folder / ".partial.1.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in [header, *({"i": i, "out": f"saved {i}"} for i in rank1)])
    )
    err = torchrun(tmp_path / "resumed")
    assert (
        f"continuing: {len(rank1)} of 40" in err and "sentences of rank 1" not in err and "sentences of rank 0" in err
    )
    got, want = (load_split("mt-en-de", "train", tmp_path / d).tgt for d in ("resumed", "one"))
    assert [got[i] for i in rank1] == [f"saved {i}" for i in rank1]
    assert all(got[i] == want[i] for i in range(40) if i not in rank1)
