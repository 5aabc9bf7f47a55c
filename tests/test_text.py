"""Text pipeline: basic_english rules, train-only vocabulary, padding, BERT WordPiece."""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedfew.data.base import DataNotFoundError
from fedfew.data.text import BERT_VOCAB_RELPATH, build_tokenizer, encode_texts, hub_offline

BERT_VOCAB = str(BERT_VOCAB_RELPATH)
AGNEWS_FILES = ("ag_news_csv/train.csv", "ag_news_csv/test.csv")


def _pieces(tok, text: str) -> list[str]:
    """Words after normalisation and pre-tokenisation (before the vocabulary lookup)."""
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text))]


# torchtext.data.utils._basic_english_normalize, verbatim (torchtext itself is not a dependency)
_TORCHTEXT_RULES = [
    (re.compile(p), r)
    for p, r in zip(
        [r"\'", r"\"", r"\.", r"<br \/>", r",", r"\(", r"\)", r"\!", r"\?", r"\;", r"\:", r"\s+"],
        [" '  ", "", " . ", " ", " , ", " ( ", " ) ", " ! ", " ? ", " ", " ", " "],
    )
]


def torchtext_basic_english(line: str) -> list[str]:
    line = line.lower()
    for pattern, repl in _TORCHTEXT_RULES:
        line = pattern.sub(repl, line)
    return line.split()


SENTENCE = 'Hello, World! It\'s 3.5 (great)?<br />Yes; no: "Quoted"\tTAB'
SENTENCE_TOKENS = [
    "hello", ",", "world", "!", "it", "'", "s", "3", ".", "5", "(", "great", ")", "?",
    "yes", "no", "quoted", "tab",
]


def test_basic_english_hand_computed() -> None:
    tok = build_tokenizer("basic_english", [SENTENCE], 100, Path("."))
    assert _pieces(tok, SENTENCE) == SENTENCE_TOKENS
    assert torchtext_basic_english(SENTENCE) == SENTENCE_TOKENS
    ids = tok.encode(SENTENCE).ids
    assert len(ids) == len(SENTENCE_TOKENS) and min(ids) >= 2  # every word is in the vocabulary
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<unk>") == 1


def test_vocab_from_train_texts_only() -> None:
    texts = ["apple banana apple", "apple cherry", "durian apple zebra", "banana"]
    cfg = OmegaConf.create({"tokenizer": "basic_english", "max_vocab": 100, "max_length": 5})
    tokens, lengths, vocab_size = encode_texts(texts, np.array([0, 1, 3]), cfg, Path("."))
    # vocabulary: <pad>, <unk>, apple (3x), banana (2x), cherry (1x); most frequent first
    assert vocab_size == 5
    apple, banana, cherry = 2, 3, 4
    assert tokens.tolist() == [
        [apple, banana, apple, 0, 0],
        [apple, cherry, 0, 0, 0],
        [1, apple, 1, 0, 0],  # "durian" and "zebra" occur only in a non-train text -> <unk>
        [banana, 0, 0, 0, 0],
    ]
    assert lengths.tolist() == [3, 2, 3, 1]


def test_padding_truncation_lengths() -> None:
    texts = ["one two three four five six", "one", "", "two two"]
    tokens, lengths, vocab_size = encode_texts(texts, np.arange(4), {"max_length": 4}, Path("."))
    assert tokens.dtype == torch.int64 and lengths.dtype == torch.int64
    assert tokens.shape == (4, 4) and lengths.shape == (4,)
    assert lengths.tolist() == [4, 1, 1, 2]  # truncated, short, empty (one <unk>), short
    assert tokens[2].tolist() == [1, 0, 0, 0]
    for row, n in zip(tokens, lengths):
        assert (row[n:] == 0).all() and (row[:n] != 0).all()
    assert int(tokens.max()) < vocab_size == 2 + 6


def test_max_vocab_respected() -> None:
    texts = ["a a a a b b b c c d e f g"]
    tokens, _, vocab_size = encode_texts(texts, np.array([0]), {"max_vocab": 5, "max_length": 20}, Path("."))
    assert vocab_size == 5  # <pad>, <unk>, a, b, c
    assert tokens[0, :13].tolist() == [2, 2, 2, 2, 3, 3, 3, 4, 4, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="max_vocab"):
        encode_texts(texts, np.array([0]), {"max_vocab": 1}, Path("."))


def test_deterministic_and_defaults() -> None:
    texts = [f"word{i % 7} other{i % 3} the" for i in range(50)]
    a = encode_texts(texts, np.arange(0, 50, 2), None, Path("."))
    b = encode_texts(texts, np.arange(0, 50, 2), {}, Path("."))
    assert a[0].shape == (50, 200)  # default max_length
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        encode_texts(["x"], np.array([0]), {"tokenizer": "gpt2"}, Path("."))
    with pytest.raises(ValueError, match="max_length"):
        encode_texts(["x"], np.array([0]), {"max_length": 0}, Path("."))
    with pytest.raises(ValueError, match="out of range"):
        encode_texts(["x"], np.array([3]), {}, Path("."))


def test_hub_offline_restores_flags() -> None:
    import huggingface_hub.constants as hc

    before = hc.HF_HUB_OFFLINE
    with hub_offline():
        assert hc.HF_HUB_OFFLINE is True
    assert hc.HF_HUB_OFFLINE == before


# ----------------------------------------------------------------------------------- BERT
def test_bert_vocab_checks(tmp_path: Path) -> None:
    path = tmp_path / BERT_VOCAB_RELPATH
    path.parent.mkdir(parents=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path.write_text("\n".join(specials + ["hello", "world", "##s"]) + "\n", encoding="utf-8")
    tok = build_tokenizer("bert-base-uncased", [], 0, tmp_path)
    assert tok.get_vocab_size() == 8
    assert tok.encode("Hello worlds").ids == [2, 5, 6, 7, 3]
    path.write_text("\n".join(specials + ["hello", "hello"]) + "\n", encoding="utf-8")  # duplicate line
    with pytest.raises(ValueError, match="lines"):
        build_tokenizer("bert-base-uncased", [], 0, tmp_path)
    path.write_text("hello\nworld\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a BERT"):
        build_tokenizer("bert-base-uncased", [], 0, tmp_path)


def test_bert_missing_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    if isinstance(huggingface_hub.try_to_load_from_cache("bert-base-uncased", "tokenizer_config.json"), str):
        pytest.skip("bert-base-uncased is in the local HF cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataNotFoundError) as info:
        encode_texts(["hello"], np.array([0]), {"tokenizer": "bert-base-uncased"}, tmp_path)
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert str(tmp_path / "tokenizers" / "bert-base-uncased" / "vocab.txt") in msg
    assert "FEDFEW_DATA_DIR" in msg


@pytest.mark.realdata(BERT_VOCAB)
def test_bert_real_vocab(real_data_dir: Path) -> None:
    tok = build_tokenizer("bert-base-uncased", [], 0, real_data_dir)
    assert tok.get_vocab_size() == 30522
    assert tok.encode("hello world").ids == [101, 7592, 2088, 102]
    assert tok.encode("Hello, WORLD!").tokens == ["[CLS]", "hello", ",", "world", "!", "[SEP]"]
    texts = ["hello world", "", " ".join(["hello"] * 50)]
    tokens, lengths, vocab_size = encode_texts(
        texts, np.array([0]), {"tokenizer": "bert-base-uncased", "max_length": 8}, real_data_dir
    )
    assert vocab_size == 30522
    assert lengths.tolist() == [4, 2, 8]
    assert tokens.tolist() == [
        [101, 7592, 2088, 102, 0, 0, 0, 0],
        [101, 102, 0, 0, 0, 0, 0, 0],
        [101] + [7592] * 6 + [102],  # truncation keeps [SEP]
    ]


# ------------------------------------------------------------------------------ real AG News
@pytest.fixture(scope="module")
def agnews_real():
    from conftest import real_data_dir

    from fedfew.data.datasets.agnews import load

    root = real_data_dir(*AGNEWS_FILES)
    return load({}, root), root


@pytest.mark.realdata(*AGNEWS_FILES)
def test_basic_english_matches_torchtext_on_agnews(agnews_real) -> None:
    ds, _ = agnews_real
    tok = build_tokenizer("basic_english", ds.texts[:10], 10, Path("."))  # rules do not depend on the vocab
    assert all(_pieces(tok, t) == torchtext_basic_english(t) for t in ds.texts)


@pytest.mark.realdata(*AGNEWS_FILES)
def test_encode_agnews_train_vocab(agnews_real) -> None:
    ds, root = agnews_real
    train_index = np.flatnonzero(~ds.official_test.numpy())  # the 2,000 train.csv rows
    start = time.monotonic()
    tokens, lengths, vocab_size = encode_texts(ds.texts, train_index, {}, root)
    assert time.monotonic() - start < 10  # about 0.4 s
    assert tokens.shape == (9600, 200) and lengths.shape == (9600,)
    assert vocab_size == 11099  # distinct basic_english words of the 2,000 train rows + 2 specials
    assert int(lengths.sum()) == 421502 and abs(float(lengths.float().mean()) - 43.906) < 1e-3
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 200
    assert int((tokens[:2000] == 1).sum()) == 0  # every train word is in the vocabulary
    assert int((tokens[2000:] == 1).sum()) == 36140  # test-only words -> <unk>
    # first row: "wall st . bears claw back into the black ( reuters ) reuters - short-sellers ,
    # wall street '  s dwindling band of ultra-cynics , are seeing green again ." = 30 words
    assert int(lengths[0]) == 30
    vocab = build_tokenizer("basic_english", [ds.texts[i] for i in train_index], 32000, root).get_vocab()
    inverse = {i: w for w, i in vocab.items()}
    assert [inverse[int(i)] for i in tokens[0, :30]] == torchtext_basic_english(ds.texts[0])
    # a word that occurs in test rows only maps to <unk>
    train_words = {w for i in train_index for w in torchtext_basic_english(ds.texts[i])}
    test_only = next(
        (r, j) for r in range(2000, 9600) for j, w in enumerate(torchtext_basic_english(ds.texts[r])[:200])
        if w not in train_words
    )
    assert int(tokens[test_only]) == 1
