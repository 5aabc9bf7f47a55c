"""Text pipeline: tokenizer construction and batch encoding to padded id tensors.

Two tokenizers are available (dataset config key ``tokenizer``):

``basic_english`` (default)
    torchtext's ``get_tokenizer("basic_english")`` rebuilt with HF ``tokenizers``: lowercase,
    then the torchtext regex rules applied in torchtext's order (``'`` -> ``" '  "``, ``"``
    removed, ``.`` ``,`` ``(`` ``)`` ``!`` ``?`` surrounded by spaces, ``<br />`` ``;`` ``:``
    -> space), then a split on whitespace runs. A word-level vocabulary of at most
    ``max_vocab`` entries (the two specials included) is trained on the *training* texts
    only, most frequent first; ``<pad>`` = 0, ``<unk>`` = 1.
``bert-base-uncased``
    The WordPiece tokenizer of BERT (30,522 entries, ``[PAD]`` = 0, ``[UNK]`` = 100,
    ``[CLS]`` = 101, ``[SEP]`` = 102), read from ``<data_dir>/tokenizers/bert-base-uncased/
    vocab.txt`` if present, else from the Hugging Face hub / local HF cache. Every sequence
    is wrapped as ``[CLS] ... [SEP]``.

Sequences are truncated to ``max_length`` ids (special tokens included) and right-padded with
0. The hub is only contacted when it answers within a few seconds (:func:`hub_reachable`);
otherwise only the local HF cache is consulted, so an offline machine fails in about a second
with a :class:`~fedfew.data.base.DataNotFoundError` instead of retrying for minutes.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from fedfew.data.base import DataNotFoundError

__all__ = [
    "BASIC_ENGLISH_RULES",
    "BERT_VOCAB_RELPATH",
    "PAD_ID",
    "UNK_ID",
    "TOKENIZERS",
    "basic_english_tokenizer",
    "bert_tokenizer",
    "build_tokenizer",
    "encode_texts",
    "hub_offline",
    "hub_reachable",
]

PAD_ID = 0
"""Padding id of every tokenizer (``<pad>`` / ``[PAD]``)."""
UNK_ID = 1
"""Unknown-word id of ``basic_english`` (``<unk>``); BERT's ``[UNK]`` is 100."""

TOKENIZERS = ("basic_english", "bert-base-uncased")
"""Accepted values of the dataset config key ``tokenizer``."""

BERT_VOCAB_RELPATH = Path("tokenizers") / "bert-base-uncased" / "vocab.txt"
"""Where the BERT vocabulary is looked for, relative to the data directory."""

# torchtext.data.utils._basic_english_normalize: (pattern, replacement), applied in this order
# after lowercasing. torchtext's final rule (r"\s+" -> " ") followed by str.split() is the
# WhitespaceSplit pre-tokenizer here.
BASIC_ENGLISH_RULES: tuple[tuple[str, str], ...] = (
    (r"'", " '  "),
    (r'"', ""),
    (r"\.", " . "),
    (r"<br \/>", " "),
    (r",", " , "),
    (r"\(", " ( "),
    (r"\)", " ) "),
    (r"!", " ! "),
    (r"\?", " ? "),
    (r";", " "),
    (r":", " "),
)

_HUB_PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


# --------------------------------------------------------------------------- hub access
def _env_offline() -> bool:
    """True when the user asked for offline mode through the usual HF environment variables."""
    return any(
        os.environ.get(var, "").strip().upper() in _TRUE
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_reachable(timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub (or the HTTPS proxy in front of it) accepts a TCP connection.

    The host is ``HF_ENDPOINT`` (default ``https://huggingface.co``), or the host of
    ``HTTPS_PROXY`` when one is set. Name resolution and connection run in a daemon thread,
    so the answer comes within ``timeout`` seconds even when DNS hangs.

    Returns:
        False when offline mode is requested (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` or
        ``TRANSFORMERS_OFFLINE`` set to a true value) or the host does not answer in time.
    """
    if _env_offline():
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlsplit(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname
    if not host:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="fedfew-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Put ``huggingface_hub`` (and ``datasets`` if imported) in offline mode temporarily.

    Both libraries read ``HF_HUB_OFFLINE`` once, at import; this flips their module-level flags
    for the duration of the block (restored afterwards), so that ``datasets.load_dataset`` only
    looks at the local cache instead of retrying an unreachable host for tens of seconds.
    """
    import sys

    import huggingface_hub.constants as hub_constants

    patched: list[tuple[Any, str, Any]] = [(hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE)]
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        for attr in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            if hasattr(ds_config, attr):
                patched.append((ds_config, attr, getattr(ds_config, attr)))
    try:
        for module, attr, _ in patched:
            setattr(module, attr, True)
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


# --------------------------------------------------------------------------- tokenizers
def basic_english_tokenizer(train_texts: Sequence[str], max_vocab: int = 32000) -> Tokenizer:
    """torchtext's ``basic_english`` tokenizer with a word vocabulary trained on ``train_texts``.

    Args:
        train_texts: the texts the vocabulary is counted on (training samples only).
        max_vocab: vocabulary size cap, the specials ``<pad>`` (0) and ``<unk>`` (1) included;
            the most frequent words are kept (ties broken alphabetically).
    Returns:
        A ``tokenizers.Tokenizer``; out-of-vocabulary words encode to 1.
    Raises:
        ValueError: ``max_vocab < 2``.
    """
    if max_vocab < 2:
        raise ValueError(f"max_vocab must be >= 2 (room for <pad> and <unk>), got {max_vocab}")
    tok = Tokenizer(models.WordLevel(vocab={"<pad>": PAD_ID, "<unk>": UNK_ID}, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Lowercase()] + [normalizers.Replace(Regex(p), r) for p, r in BASIC_ENGLISH_RULES]
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=int(max_vocab), min_frequency=0, special_tokens=["<pad>", "<unk>"], show_progress=False
    )
    tok.train_from_iterator(list(train_texts), trainer=trainer, length=len(train_texts))
    if tok.token_to_id("<pad>") != PAD_ID or tok.token_to_id("<unk>") != UNK_ID:  # pragma: no cover
        raise RuntimeError("basic_english vocabulary lost its special ids (<pad>=0, <unk>=1)")
    return tok


def _count_vocab_lines(path: Path) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(1 for line in fh if line.rstrip("\r\n"))


def _bert_from_vocab(vocab_path: Path) -> Tokenizer:
    """bert-base-uncased's pipeline (BertNormalizer, BertPreTokenizer, WordPiece, [CLS]/[SEP])."""
    tok = Tokenizer(models.WordPiece.from_file(str(vocab_path), unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    missing = [s for s in specials if tok.token_to_id(s) is None]
    if missing:
        raise ValueError(f"{vocab_path} is not a BERT WordPiece vocabulary: missing {missing}")
    tok.add_special_tokens(specials)  # already in the vocabulary: protects them from splitting
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    expected = _count_vocab_lines(vocab_path)
    if tok.get_vocab_size() != expected:
        raise ValueError(
            f"BERT tokenizer built from {vocab_path} has {tok.get_vocab_size()} entries but the file "
            f"has {expected} lines"
        )
    return tok


def _bert_from_hub(name: str) -> Tokenizer:
    """The backend ``tokenizers.Tokenizer`` of ``AutoTokenizer.from_pretrained(name)``."""
    from transformers import AutoTokenizer

    online = hub_reachable()
    hf_tok = AutoTokenizer.from_pretrained(name, local_files_only=not online)
    tok = getattr(hf_tok, "backend_tokenizer", None)
    if not isinstance(tok, Tokenizer):
        raise ValueError(f"AutoTokenizer.from_pretrained({name!r}) has no fast (tokenizers) backend")
    tok = Tokenizer.from_str(tok.to_str())  # own copy: padding/truncation changes stay local
    if tok.get_vocab_size() != len(hf_tok):
        raise ValueError(
            f"{name}: backend vocabulary has {tok.get_vocab_size()} entries, the tokenizer {len(hf_tok)}"
        )
    return tok


def bert_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The bert-base-uncased WordPiece tokenizer (vocabulary of 30,522 entries).

    Source order: ``<data_dir>/tokenizers/bert-base-uncased/vocab.txt`` if it exists, else
    ``transformers.AutoTokenizer.from_pretrained("bert-base-uncased")`` (hub, or the local HF
    cache only when the hub does not answer). "hello world" encodes to [101, 7592, 2088, 102].

    Raises:
        DataNotFoundError: no vocabulary file and none obtainable from the hub/cache; the
            message names the expected vocab path and the settings to change.
        ValueError: the vocabulary file is not a BERT vocabulary, or the tokenizer's size
            differs from the number of lines in the file.
    """
    vocab_path = Path(data_dir) / BERT_VOCAB_RELPATH
    if vocab_path.is_file():
        return _bert_from_vocab(vocab_path)
    try:
        return _bert_from_hub("bert-base-uncased")
    except (OSError, ValueError, ImportError) as exc:
        raise DataNotFoundError(
            f"bert-base-uncased vocabulary not found: expected {vocab_path} (one WordPiece token a "
            f"line, 30,522 lines), and it could not be loaded from the Hugging Face hub or cache "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Get vocab.txt "
            f"from https://huggingface.co/bert-base-uncased/blob/main/vocab.txt and place it there, "
            f"or point the data directory at a folder holding tokenizers/bert-base-uncased/vocab.txt "
            f"(`data_dir=...` or the FEDFEW_DATA_DIR environment variable), or use "
            f"`dataset.tokenizer=basic_english`."
        ) from exc


def build_tokenizer(name: str, train_texts: Sequence[str], max_vocab: int, data_dir: str | Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` for the dataset config value ``tokenizer``.

    Args:
        name: ``"basic_english"`` or ``"bert-base-uncased"``.
        train_texts: training texts; the ``basic_english`` vocabulary is counted on them only
            (ignored by BERT, whose vocabulary is fixed).
        max_vocab: ``basic_english`` vocabulary cap, specials included (ignored by BERT).
        data_dir: data directory (BERT's ``tokenizers/bert-base-uncased/vocab.txt``).
    Returns:
        The tokenizer, without padding or truncation configured; pad id 0.
    Raises:
        ValueError: unknown ``name`` (the message lists the accepted values).
        DataNotFoundError: BERT vocabulary not found (see :func:`bert_tokenizer`).
    """
    if name == "basic_english":
        return basic_english_tokenizer(train_texts, max_vocab)
    if name == "bert-base-uncased":
        return bert_tokenizer(data_dir)
    raise ValueError(f"unknown tokenizer '{name}'; available: {', '.join(TOKENIZERS)} (set `dataset.tokenizer=...`)")


def _cfg_get(cfg: Any, key: str, default: Any) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def encode_texts(
    texts: Sequence[str], train_index: np.ndarray, cfg: Any, data_dir: str | Path
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenise every text with a tokenizer fitted on the training texts only.

    Args:
        texts: the N raw strings of the pooled dataset.
        train_index: int indices into ``texts`` of the training samples (union of the
            clients' train splits); the ``basic_english`` vocabulary is built from these only,
            so words seen only in test texts encode to ``<unk>`` = 1.
        cfg: dataset config (mapping/DictConfig) with ``tokenizer`` (``"basic_english"``
            default, or ``"bert-base-uncased"``), ``max_vocab`` (32000), ``max_length`` (200).
        data_dir: data directory (for the BERT vocabulary).
    Returns:
        ``(tokens, lengths, vocab_size)``: tokens (N, max_length) int64 ids, truncated to
        ``max_length`` and right-padded with 0; lengths (N,) int64 number of real ids, >= 1
        (an empty text becomes the single unknown-word id); vocab_size the number of ids
        (every id is < vocab_size).
    Raises:
        ValueError: unknown tokenizer, ``max_length < 1``, or ``train_index`` out of range.
        DataNotFoundError: BERT vocabulary not found.
    """
    name = str(_cfg_get(cfg, "tokenizer", "basic_english"))
    max_vocab = int(_cfg_get(cfg, "max_vocab", 32000))
    max_length = int(_cfg_get(cfg, "max_length", 200))
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    texts = [str(t) for t in texts]
    train_index = np.asarray(train_index, dtype=np.int64).reshape(-1)
    if len(train_index) and (train_index.min() < 0 or train_index.max() >= len(texts)):
        raise ValueError(f"train_index out of range for {len(texts)} texts")

    if name == "bert-base-uncased" and max_length < 2:
        raise ValueError(f"max_length must be >= 2 with BERT ([CLS] and [SEP]), got {max_length}")
    tok = build_tokenizer(name, [texts[i] for i in train_index], max_vocab, data_dir)
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    unk_id = tok.token_to_id("[UNK]" if name == "bert-base-uncased" else "<unk>")
    unk_id = UNK_ID if unk_id is None else unk_id

    tokens = np.full((len(texts), max_length), PAD_ID, dtype=np.int64)
    lengths = np.ones(len(texts), dtype=np.int64)
    for row, enc in enumerate(tok.encode_batch(texts)):
        ids = enc.ids[:max_length]
        if ids:
            tokens[row, : len(ids)] = ids
            lengths[row] = len(ids)
        else:  # empty text: one unknown word, so that every sequence has length >= 1
            tokens[row, 0] = unk_id
    return torch.from_numpy(tokens), torch.from_numpy(lengths), int(tok.get_vocab_size())
