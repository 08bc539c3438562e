"""Tokenizers behind one small interface: the built-in byte-level one, or any Hugging Face tokenizer."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from nanopt import hub
from nanopt.data.fastbpe import tiktoken_encoding
from nanopt.errors import ConfigError

log = logging.getLogger("nanopt")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: Optional[int]
    eos_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self) -> list[int]: ...  # UTF-8 bytes of each token id (0 for special ones), for bits-per-byte


class ByteTokenizer:
    """UTF-8 bytes are the tokens (0..255); 256 marks the beginning of a document. Needs no files."""

    name = "byte"
    vocab_size = 257
    bos_id: Optional[int] = 256
    eos_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """One uint32 array per text (no Python int per token: nanopt prepare's path)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[int]:
        return [1] * 256 + [0]


def get_tokenizer(name: str) -> Tokenizer:
    """`byte` -> ByteTokenizer; anything else is a Hugging Face tokenizer name or directory."""
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


class HFTokenizer:
    """Any `transformers.AutoTokenizer` (a hub name, with HF_TOKEN for gated repos, or a directory)."""

    def __init__(self, name: str):
        if not Path(name).is_dir():
            hub.offline_unless_reachable()  # before transformers loads: it reads the offline switch then
        try:
            from transformers import AutoTokenizer  # optional dependency: the `data` extra
        except ImportError:
            raise ConfigError(f"`data.tokenizer` is {name!r}, which needs the transformers package: "
                              f"pip install -e '.[data]' (or use `data.tokenizer: byte`).") from None
        try:
            self.hf = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # the last three: damaged files
            if hub.is_unreachable_error(e):
                raise ConfigError(hub.not_cached(f"`data.tokenizer` {name!r}", e, "Or set `data.tokenizer` to a "
                                                 "local directory with the tokenizer files (or `byte`).")) from None
            why = " ".join(f"{e.__class__.__name__}: {e}".split())  # transformers' messages span lines
            raise ConfigError(f"`data.tokenizer` {name!r} cannot be loaded as a Hugging Face tokenizer ({why}). Give "
                              f"a local directory with tokenizer files or a hub name you have access to.") from None
        self.name, self.vocab_size = name, len(self.hf)
        self.bos_id, self.eos_id = self.hf.bos_token_id, self.hf.eos_token_id
        self._tiktoken = None  # None: not built yet; False: not usable for this tokenizer
        self._tiktoken_checked = False

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """One uint32 array per document, the ids `encode` gives. Byte-level BPE runs on tiktoken where it can
        (fastbpe.py: no Python int per token); the first batch is encoded by both engines, and any difference
        keeps the Hugging Face one for good."""
        if self.fast_engine() is None:
            return [np.array(ids, dtype=np.uint32) for ids in self._encode_batch_hf(texts)]
        arrays = [self._tiktoken.encode_to_numpy(t, allowed_special="all") for t in texts]
        if not self._tiktoken_checked:
            self._tiktoken_checked = True
            reference = self._encode_batch_hf(texts)
            if [a.tolist() for a in arrays] != reference:
                log.warning("tokenizer %s: the tiktoken engine disagrees with Hugging Face on the first batch; "
                            "using the Hugging Face engine", self.name)
                self._tiktoken = False
                return [np.array(ids, dtype=np.uint32) for ids in reference]
        return arrays

    def fast_engine(self):
        """The tiktoken engine (built once, before prepare forks its workers), or None: not installed or not
        equivalent."""
        if self._tiktoken is None:
            self._tiktoken = (tiktoken_encoding(self.definition()) if self.hf.is_fast else None) or False
            if self._tiktoken is False:  # say so: the Hugging Face engine is several times slower per core
                log.info("tokenizer %s: not plain byte-level BPE or tiktoken not installed; using the Hugging Face "
                         "engine", self.name)
        return self._tiktoken or None

    def _encode_batch_hf(self, texts: list[str]) -> list[list[int]]:
        if self.hf.is_fast:
            backend = self.hf.backend_tokenizer
            # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: about 2x faster here.
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def definition(self) -> str:
        """The full definition (tokenizer.json for fast tokenizers), for fingerprints."""
        return self.hf.backend_tokenizer.to_str() if self.hf.is_fast else repr(sorted(self.hf.get_vocab().items()))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_bytes(self) -> list[int]:
        special = set(self.hf.all_special_ids)
        return [0 if i in special else len(self.hf.decode([i]).encode("utf-8")) for i in range(self.vocab_size)]
