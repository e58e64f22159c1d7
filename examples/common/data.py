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
    return b"".join(pieces)[:max_bytes]


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
