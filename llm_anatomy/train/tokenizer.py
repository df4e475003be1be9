"""A byte-level BPE tokenizer (the `tokenizers` library) trained locally, cached by corpus and vocab.

Nothing is fetched from a hub. The cache entry for a corpus is a folder

    <cache>/bpe-<corpus sha256, 16 hex>-v<vocab>/
        tokenizer.json   the trained tokenizer (Tokenizer.from_file reads it)
        tokens.bin       the whole corpus encoded, documents joined by <|endoftext|> (data.py's .bin format)
        meta.json        corpus hash, vocab asked for and reached, token count, recipe

written into a temp folder and renamed, so a second run (or another process racing this one) sees
a complete entry or none. The key holds the corpus hash *and* the vocab because either changes the
merges; RECIPE is in the hash too, so a change to how we train invalidates old entries.

Why byte-level: every byte string encodes (no <unk>), so any user text trains and encodes, at the
cost of a 256-symbol base alphabet: the vocab must be at least 257 (256 bytes + <|endoftext|>).
A small corpus may stop short of the vocab asked for (every word already one token); the model
keeps its configured vocab and the unused rows of the embedding simply never receive a gradient.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from llm_anatomy.config import ConfigError
from llm_anatomy.train.storage import storage_error

EOT = "<|endoftext|>"
RECIPE = "bytelevel-bpe/eot/v1"
MIN_VOCAB = 256 + 1  # byte alphabet + <|endoftext|>


def default_cache_dir() -> Path:
    """$ANATOMY_CACHE, else $XDG_CACHE_HOME/anatomy, else ~/.cache/anatomy."""
    if os.environ.get("ANATOMY_CACHE"):
        return Path(os.environ["ANATOMY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "anatomy"


def corpus_hash(docs: Iterable[str]) -> str:
    """sha256 over the documents, each length-prefixed (so ["ab", "c"] and ["a", "bc"] differ)."""
    h = hashlib.sha256(RECIPE.encode())
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + (b"e" if getattr(d, "end", True) else b"p"))
        h.update(b)
    return h.hexdigest()


def train_bpe(docs: Iterable[str], vocab: int):
    """Train a byte-level BPE with <|endoftext|> as id 0 on an iterable of documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < MIN_VOCAB:
        raise ConfigError(f"vocab={vocab} is too small for a byte-level BPE tokenizer (needs >= {MIN_VOCAB}: "
                          f"256 bytes + {EOT}); give --vocab {MIN_VOCAB} or more, or a pre-tokenized .bin")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


@dataclass
class CachedTokenizer:
    path: Path  # the cache entry folder
    hit: bool  # True when it was read from the cache, False when trained now
    vocab_size: int  # the size training reached (<= the vocab asked for)
    tokens: int  # length of tokens.bin

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def tokens_file(self) -> Path:
        return self.path / "tokens.bin"

    def load(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_file))


class Piece(str):
    """A piece of a long document: `end` is False for every piece but the last (no EOT after it)."""

    def __new__(cls, text: str, end: bool = True):
        self = super().__new__(cls, text)
        self.end = end
        return self


def token_dtype(vocab: int) -> str:
    return "uint16" if vocab <= 2**16 else "uint32"


def _encode_to(tok, docs: Iterable[str], out: Path, dtype: str, batch: int = 256) -> int:
    """Encode documents in batches and append their ids to `out`, each document followed by EOT."""
    import numpy as np

    eot = tok.token_to_id(EOT)
    n = 0
    with open(out, "wb") as f:
        buf: list[str] = []

        def flush():
            nonlocal n
            for d, enc in zip(buf, tok.encode_batch(buf)):
                ids = np.asarray(enc.ids + [eot] if getattr(d, "end", True) else enc.ids, dtype=dtype)
                f.write(ids.tobytes())
                n += ids.size
            buf.clear()

        for d in docs:
            buf.append(d)
            if len(buf) == batch:
                flush()
        flush()
    return n


def load_or_train(docs: Callable[[], Iterator[str]], vocab: int, cache_dir: str | Path | None = None,
                  key: str | None = None) -> CachedTokenizer:
    """The tokenizer and encoded corpus for `docs` at `vocab`, from the cache or trained now.

    docs: a callable returning a fresh iterator over the documents (it is read up to three times:
    hash, train, encode). key: a precomputed corpus fingerprint (e.g. a dataset's own), else hashed.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = key or corpus_hash(docs())
    entry = cache / f"bpe-{digest[:16]}-v{vocab}"
    if (entry / "meta.json").is_file():
        meta = json.loads((entry / "meta.json").read_text())
        return CachedTokenizer(entry, True, meta["vocab_size"], meta["tokens"])
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=cache))
    except OSError as e:
        raise storage_error(e, f"the tokenizer cache {cache}") from None
    try:
        tok = train_bpe(docs(), vocab)
        # serialised by tokenizers, written by Python: a failed write is an OSError with its errno
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
        size = tok.get_vocab_size()
        n = _encode_to(tok, docs(), tmp / "tokens.bin", token_dtype(vocab))
        meta = dict(recipe=RECIPE, corpus_sha256=digest, vocab_asked=vocab, vocab_size=size, tokens=n,
                    dtype=token_dtype(vocab), eot_id=tok.token_to_id(EOT))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the entry complete
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first: theirs is as good as ours
            if not (entry / "meta.json").is_file():
                raise
    except OSError as e:
        raise storage_error(e, f"the tokenizer cache {cache}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CachedTokenizer(entry, False, size, n)
