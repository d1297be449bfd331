"""The shipped data: present, aligned, and split by document."""

from __future__ import annotations

import pytest

from refdec.data import TASKS, load_split, token_batches

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
