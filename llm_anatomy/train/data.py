"""Training data: where tokens come from, the train/eval split, and a batch order that is a pure
function of (seed, sample position), so a resumed run sees exactly the batches it would have seen.

Sources (--data):
  nothing          the embedded default corpus (llm_anatomy/train/corpus/, see its NOTICE.md)
  *.txt / a folder of *.txt
                   your text: one document per file; a BPE tokenizer is trained to the config's
                   vocab and the encoded tokens cached (tokenizer.py)
  *.bin            pre-tokenized, nanoGPT's format: a flat array of token ids, little-endian,
                   no header, uint16 (default) or uint32 (--bin-dtype); documents are separated
                   by whatever end-of-text id you used. Every id must be < the config's vocab.
  a folder saved by datasets' save_to_disk
                   a Hugging Face dataset (needs `pip install datasets`): a text column is
                   tokenized as above; an `input_ids` column is taken as tokens.

Split: the last --eval-frac of the token stream is held out for eval (contiguous, so no eval
window overlaps a train window).

Order: the train stream is cut into W = (N - 1) // S non-overlapping windows of S + 1 tokens
(x = w[:-1], y = w[1:]). Epoch e visits them in randperm(W) seeded by (seed, e). Sample k of
the run is window perm_{k // W}[k % W]; at each step rank r takes samples consumed + r·B ...
consumed + r·B + B - 1, and consumed grows by B·world. The checkpoint stores `consumed`, so the
position survives a restart, even onto a different world size.
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llm_anatomy.config import ConfigError
from llm_anatomy.io import open_input
from llm_anatomy.train import tokenizer as tk

CORPUS = Path(__file__).parent / "corpus" / "python_reference.txt"
DOC_SEP = "\f\n"  # the default corpus separates its documents with a form-feed line
BIN_DTYPES = ("uint16", "uint32")
# each data file: a regular file (a FIFO or a device is refused by name) of at most these bytes; both are
# read in pieces (text) or mapped (token ids), so the bounds sit far above any real corpus file
MAX_TEXT_BYTES = 64 << 30
MAX_BIN_BYTES = 1 << 40
_TEXT_CHUNK = 1 << 20  # a long text file reaches the tokenizer in ~1 MiB pieces, cut at line ends


@dataclass
class TokenData:
    train: np.ndarray  # (N_train,) token ids (a memmap for files)
    eval: np.ndarray  # (N_eval,)
    source: str  # for humans: what was read
    fingerprint: str  # sha256 of the token source: a checkpoint refuses to resume onto other data
    tokenizer: dict = field(default_factory=dict)  # path, cache hit, vocab reached (text sources)

    def describe(self) -> dict:
        return dict(source=self.source, fingerprint=self.fingerprint, train_tokens=int(self.train.size),
                    eval_tokens=int(self.eval.size), tokenizer=self.tokenizer)


# ---- sources ------------------------------------------------------------------------------------
def default_corpus_docs() -> list[str]:
    return CORPUS.read_text(encoding="utf-8").split(DOC_SEP)


def _text_file_docs(files: list[Path]) -> Iterator[str]:
    """One document per file, yielded in ~1 MiB pieces (the tokenizer never holds a whole big file).

    Only a file's last piece has `end` set: <|endoftext|> goes between files, not between pieces."""
    for f in files:
        with io.TextIOWrapper(open_input(f, "training text", MAX_TEXT_BYTES), encoding="utf-8") as fh:
            chunk = fh.read(_TEXT_CHUNK)
            while chunk:
                chunk += fh.readline()  # finish the line, so no word is split between pieces
                nxt = fh.read(_TEXT_CHUNK)
                yield tk.Piece(chunk, end=not nxt)
                chunk = nxt


def _is_hf_dataset(d: Path) -> bool:
    return any((d / n).is_file() for n in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _classify(paths: list[str]) -> tuple[str, list[Path]]:
    out = []
    for s in paths:
        p = Path(s).expanduser()
        if not p.exists():
            raise ConfigError(f"no such data file or folder: {s}")
        out.append(p)
    kinds = set()
    files: list[Path] = []
    for p in out:
        if p.is_dir():
            if _is_hf_dataset(p):
                kinds.add("hf")
                files.append(p)
                continue
            txt = sorted(p.rglob("*.txt"))
            if not txt:
                raise ConfigError(f"{p} is a folder with no .txt files and is not a saved Hugging Face dataset")
            kinds.add("text")
            files += txt
        elif p.suffix == ".txt":
            kinds.add("text")
            files.append(p)
        elif p.suffix == ".bin":
            kinds.add("bin")
            files.append(p)
            open_input(p, "token-id file", MAX_BIN_BYTES).close()
        else:
            raise ConfigError(f"{p}: unsupported data file; give .txt files, a .bin of token ids, "
                              f"or a folder saved by datasets.save_to_disk")
    if len(kinds) > 1 or (kinds & {"bin", "hf"} and len(files) > 1):
        raise ConfigError("give text files, or one .bin, or one saved dataset folder: not a mix")
    for f in files if kinds == {"text"} else ():  # every file checked before the tokenizer reads the first
        open_input(f, "training text", MAX_TEXT_BYTES).close()
    return kinds.pop(), files


def _text_tokens(docs, vocab: int, cache_dir, key: str | None = None) -> tuple[np.ndarray, dict, str]:
    entry = tk.load_or_train(docs, vocab, cache_dir, key=key)
    dtype = tk.token_dtype(vocab)
    toks = np.memmap(entry.tokens_file, dtype=dtype, mode="r") if entry.tokens else np.zeros(0, dtype)
    info = dict(path=str(entry.path), cache_hit=entry.hit, vocab_asked=vocab, vocab_size=entry.vocab_size)
    return toks, info, entry.path.name


def _bin_tokens(path: Path, dtype: str, vocab: int) -> tuple[np.ndarray, str]:
    if dtype not in BIN_DTYPES:
        raise ConfigError(f"--bin-dtype must be uint16 or uint32, got {dtype!r}")
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{path} is empty")
    if size % item:
        raise ConfigError(f"{path}: {size} bytes is not a whole number of {dtype} token ids "
                          f"(is it {'uint32' if dtype == 'uint16' else 'uint16'}? see --bin-dtype)")
    toks = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    h = hashlib.sha256(f"bin/{dtype}/{size}".encode())
    top = 0
    for s in range(0, toks.size, 1 << 24):  # 16 Mi ids at a time: bounded memory on a big file
        part = toks[s:s + (1 << 24)]
        top = max(top, int(part.max()))
        h.update(part.tobytes())
    if toks.size and top >= vocab:
        raise ConfigError(f"{path} holds token id {top}, but the config's vocab is {vocab}: "
                          f"give --vocab {top + 1} or more")
    return toks, h.hexdigest()


def _hf_tokens(path: Path, vocab: int, cache_dir, column: str) -> tuple[np.ndarray, dict, str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{path} is a saved Hugging Face dataset, and reading it needs the `datasets` "
                          f"package: pip install datasets") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    cols = ds.column_names
    if "input_ids" in cols and column not in cols:
        toks = np.fromiter((t for row in ds["input_ids"] for t in row), dtype=np.int64)
        if toks.size and int(toks.max()) >= vocab:
            raise ConfigError(f"{path}: input_ids hold id {int(toks.max())} >= the config's vocab {vocab}")
        dtype = tk.token_dtype(vocab)
        return toks.astype(dtype), {}, hashlib.sha256(toks.tobytes()).hexdigest()
    if column not in cols:
        raise ConfigError(f"{path}: no column {column!r} (columns: {', '.join(cols)}); see --text-column")

    def docs():
        for i in range(0, len(ds), 1000):
            yield from (t for t in ds[i:i + 1000][column] if t)

    key = hashlib.sha256(f"hf/{getattr(ds, '_fingerprint', '')}/{column}".encode()).hexdigest()
    return _text_tokens(docs, vocab, cache_dir, key=key if getattr(ds, "_fingerprint", None) else None)


def load_data(paths: list[str] | None, vocab: int, *, cache_dir=None, bin_dtype: str = "uint16",
              text_column: str = "text", eval_frac: float = 0.1, seq: int = 1) -> TokenData:
    """Tokens for training and eval, split; every failure the user can fix is a ConfigError."""
    if not 0.0 < eval_frac < 1.0:
        raise ConfigError(f"--eval-frac must be between 0 and 1, got {eval_frac}")
    try:
        if not paths:
            toks, info, fp = _text_tokens(default_corpus_docs, vocab, cache_dir)
            source = f"embedded corpus ({CORPUS.name})"
        else:
            kind, files = _classify(paths)
            if kind == "bin":
                toks, fp = _bin_tokens(files[0], bin_dtype, vocab)
                info, source = {}, f"{files[0]} ({bin_dtype})"
            elif kind == "hf":
                toks, info, fp = _hf_tokens(files[0], vocab, cache_dir, text_column)
                source = f"Hugging Face dataset {files[0]}"
            else:
                toks, info, fp = _text_tokens(lambda: _text_file_docs(files), vocab, cache_dir)
                source = f"{len(files)} text file(s)" if len(files) > 1 else str(files[0])
    except OSError as e:
        raise ConfigError(f"cannot read the data: {e.strerror or e}: {getattr(e, 'filename', '') or ''}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"the data is not UTF-8 text: {e}") from None
    n = int(toks.size)
    n_eval = max(seq + 1, int(n * eval_frac))
    if n - n_eval < seq + 1:
        raise ConfigError(f"{source} has {n:,} tokens: too few for --seq {seq} (train and eval each need "
                          f"at least seq + 1 = {seq + 1}); give more data or a shorter --seq")
    return TokenData(toks[: n - n_eval], toks[n - n_eval:], source, fp, info)


# ---- batch order --------------------------------------------------------------------------------
def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"anatomy-data/{seed}/{epoch}".encode()).digest()[:8], "little") >> 1


class Batches:
    """Batches of S + 1 token windows in a seeded order; batch(consumed, rank) is stateless."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, *, shuffle: bool = True):
        self.tokens, self.batch, self.seq, self.seed, self.shuffle = tokens, batch, seq, seed, shuffle
        self.windows = (tokens.size - 1) // seq  # W: (S+1)-token windows overlap by one token
        if self.windows < 1:
            raise ConfigError(f"{tokens.size} tokens are too few for one window of seq {seq}")
        self._perm: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.windows)
        if epoch not in self._perm:
            if len(self._perm) > 2:
                self._perm.pop(min(self._perm))
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm[epoch] = torch.randperm(self.windows, generator=g).numpy()
        return self._perm[epoch]

    def window_ids(self, start: int) -> list[int]:
        """The window index of samples start .. start + B - 1."""
        return [int(self._order(k // self.windows)[k % self.windows]) for k in range(start, start + self.batch)]

    def position(self, consumed: int) -> dict:
        return dict(consumed=consumed, epoch=consumed // self.windows, index=consumed % self.windows,
                    windows=self.windows, seed=self.seed)

    def get(self, start: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, targets: (B, S) int64 each, separate storages."""
        S = self.seq
        rows = np.stack([np.asarray(self.tokens[w * S: w * S + S + 1], dtype=np.int64)
                         for w in self.window_ids(start)])  # (B, S + 1)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)
