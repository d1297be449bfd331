"""The shipped data: present, aligned, and split by document."""

from __future__ import annotations

import pytest

from refdec.data import TASKS, cut_batches, load_split, token_batches

MIN_TEST = {"mt-en-de": 2000, "gec-uk": 2000, "gec-en": 800}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_load_and_align(task):
    """Guards against a shipped file going missing or a source/target/doc file shifting by a line."""
    for split in ("train", "dev", "test"):
        s = load_split(task, split)  # raises if the files disagree on the number of lines
        assert len(s) > 0
        assert all(s.src) and all(s.tgt), f"{task}/{split} has empty lines"
    assert len(load_split(task, "test")) >= MIN_TEST[task]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_share_no_document(task):
    """Guards against leakage: dev and test never share a document with train or with each other."""
    docs = {split: set(load_split(task, split).docs) for split in ("train", "dev", "test")}
    assert not docs["train"] & docs["test"]
    assert not docs["train"] & docs["dev"]
    assert not docs["dev"] & docs["test"]


def test_mt_test_sentences_not_in_train():
    """Guards against near-duplicate documentation strings leaking the test set into training."""
    train = {s.lower() for s in load_split("mt-en-de", "train").src}
    test = load_split("mt-en-de", "test").src
    assert not [s for s in test if s.lower() in train]


def test_token_batches_respect_budget_and_cover_everything():
    """Guards against batches over the token budget or examples dropped by the batcher."""
    lengths = [(i % 17 + 1, i % 11 + 2) for i in range(500)]
    batches = token_batches(lengths, 200, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        s = max(lengths[i][0] for i in b) + 1
        t = max(lengths[i][1] for i in b) + 1
        assert len(b) == 1 or (s + t) * len(b) <= 200
    assert token_batches(lengths, 200, seed=3) == batches  # seeded: reproducible


def test_cut_batches_keeps_the_order_and_fills_each_batch_as_far_as_it_fits():
    """Guards the one length bucketer of training and decoding: batches are consecutive runs of the
    order given, each as long as `fits` allows on the batch's largest of each length (one example at
    least, however long), so that the next example would not have fitted."""
    lengths = [(3, 1), (1, 5), (9, 2), (2, 2), (30, 1), (1, 1), (2, 4)]
    order = [6, 0, 3, 1, 2, 4, 5]
    fits = lambda rows, longest: rows * sum(longest) <= 20  # noqa: E731
    got = cut_batches(order, lambda i: lengths[i], fits)
    assert [i for b in got for i in b] == order
    widest = lambda b: tuple(max(lengths[i][j] for i in b) for j in range(2))  # noqa: E731
    for b, nxt in zip(got, got[1:] + [None]):
        assert len(b) == 1 or fits(len(b), widest(b))
        assert nxt is None or not fits(len(b) + 1, widest(b + nxt[:1]))
    assert [4] in got  # longer than any budget: a batch of its own
    assert cut_batches([], lambda i: (0,), fits) == []


def test_text_is_read_as_users_save_it(tmp_path, capsys):
    """Case: a file saved with a UTF-8 byte-order mark (as some editors do) gave "Schließen Sie auf OK..."
    where the same line without it gave "Klicken Sie auf OK...": the mark was read as text. Every command
    reads text through read_lines, which drops it and says so once; Windows line ends go too."""
    import gzip

    from refdec.data import read_lines

    (tmp_path / "plain.txt").write_bytes(b"Click OK to close the dialog.\nSecond line.\n")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfClick OK to close the dialog.\r\nSecond line.\r\n")
    (tmp_path / "bom.txt.gz").write_bytes(gzip.compress((tmp_path / "bom.txt").read_bytes()))
    want = read_lines(tmp_path / "plain.txt")
    assert capsys.readouterr().err == ""
    for name in ("bom.txt", "bom.txt.gz"):
        assert read_lines(tmp_path / name) == want == ["Click OK to close the dialog.", "Second line."]
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"note: {tmp_path / name} starts with a UTF-8 byte-order mark")


def test_an_unreadable_text_file_is_a_one_line_error_naming_it(tmp_path):
    """Was: a data file that was not gzip raised `BadGzipFile: Not a gzipped file (b'{\\n')`, naming no file."""
    from refdec.data import read_lines
    from refdec.errors import UsageError

    (tmp_path / "bad.gz").write_bytes(b"{\n")
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(UsageError, match=r"bad\.gz is not a valid gzip file .*; give the plain text file instead$"):
        read_lines(tmp_path / "bad.gz")
    with pytest.raises(UsageError, match=r"latin1\.txt: line 2 is not valid UTF-8 \(byte 0xe9 at column 4\)"):
        read_lines(tmp_path / "latin1.txt")
