"""Real English text that needs no download: the docstrings of Python's standard library.

Every Python installation ships them (PSF licence), they are prose written by people,
and a byte-level tokenizer (vocabulary 256) needs no files either. The corpus is built
deterministically (sorted files, fixed seed), so every rank of a job sees the same text.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sysconfig

import torch

VOCAB_SIZE = 256  # byte-level: token id = UTF-8 byte


@functools.lru_cache(maxsize=1)
def load_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Docstrings of the stdlib's modules, classes and functions, joined by blank lines."""
    return b"".join(_docstrings(max_bytes))[:max_bytes]


@functools.lru_cache(maxsize=1)
def _docstrings(max_bytes: int) -> tuple[bytes, ...]:
    """The corpus's documents (one docstring each, ending in a blank line), in file order."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    pieces, size = [], 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if path.parent.name in ("test", "tests", "idlelib") or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    piece = doc.encode("utf-8") + b"\n\n"
                    pieces.append(piece)
                    size += len(piece)
        if size >= max_bytes:
            break
    return tuple(pieces)


def corpus_documents(max_bytes: int = 4_000_000) -> list[torch.Tensor]:
    """The corpus as documents (one docstring each) of byte ids, for packed training."""
    return [torch.frombuffer(bytearray(doc), dtype=torch.uint8).long() for doc in _docstrings(max_bytes)]


def corpus_tokens(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The corpus as a LongTensor of byte ids."""
    return torch.frombuffer(bytearray(load_corpus(max_bytes)), dtype=torch.uint8).long()


def split_corpus(tokens: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: the last ``val_fraction`` is held out."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


class TokenBatches:
    """Random windows of ``seq_len`` tokens from a stream, reproducible from (seed, step).

    ``batch(step)`` returns input_ids ``[batch_size, seq_len]``: the same on every rank of a
    job for a given step, so data-parallel ranks pick their slice with ``dp_rank`` and
    sequence-parallel ranks shard the same sample.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens; seq_len={seq_len} needs more")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed

    def batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size * dp_size,), generator=g)
        mine = starts[dp_rank * self.batch_size:(dp_rank + 1) * self.batch_size]
        return torch.stack([self.tokens[s:s + self.seq_len] for s in mine.tolist()])


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` tokens of a stream, as a map-style dataset.

    ``dataset[i]`` is the LongTensor ``tokens[i * seq_len:(i + 1) * seq_len]`` (``[seq_len]``),
    for samplers and ``DataLoader``s; labels are the same tokens, shifted by the collator.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if len(tokens) < seq_len:
            raise ValueError(f"the stream has {len(tokens)} tokens; seq_len={seq_len} needs at least that many")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        return self.tokens[index * self.seq_len:(index + 1) * self.seq_len]


class PackedDocuments(torch.utils.data.Dataset):
    """Documents packed end to end into windows of exactly ``seq_len`` tokens.

    ``dataset[i]`` is ``{"input_ids": [seq_len], "cu_seqlens": [k + 1]}``: the window and
    the boundaries of the ``k`` documents (or document pieces) in it, from 0 to
    ``seq_len``. A document that does not fit continues, as its own piece, in the next
    window, so no token is dropped and windows need no padding.
    """

    def __init__(self, documents: list[torch.Tensor], seq_len: int) -> None:
        stream = torch.cat(documents)
        if len(stream) < seq_len:
            raise ValueError(f"the documents hold {len(stream)} tokens; seq_len={seq_len} needs at least that many")
        ends = torch.tensor([len(d) for d in documents]).cumsum(0)
        self.stream, self.seq_len, self.doc_ends = stream, seq_len, ends

    def __len__(self) -> int:
        return len(self.stream) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start, stop = index * self.seq_len, (index + 1) * self.seq_len
        inner = self.doc_ends[(self.doc_ends > start) & (self.doc_ends < stop)] - start
        cu = torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.tensor([self.seq_len])])
        return {"input_ids": self.stream[start:stop], "cu_seqlens": cu}
