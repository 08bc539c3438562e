"""A faster engine for byte-level BPE tokenizers (GPT-2, Llama-3): the same vocabulary, merges and split pattern,
run by tiktoken, several times faster per CPU second than Hugging Face `tokenizers`. A tokenizer.json qualifies
only in the plain shape (no normaliser, a known split pattern, BPE without dropout/byte fallback, merge results
with non-decreasing ids so "lowest merged rank first" = "merge list order"); HFTokenizer also compares both
engines on its first batch and keeps the Hugging Face one on any difference.
"""
from __future__ import annotations

import json
from typing import Any, Optional

# The split pattern of tokenizers' ByteLevel pre-tokenizer with use_regex=true (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_decoder() -> dict[str, int]:
    """The byte-level alphabet: printable stand-in character -> byte (GPT-2's bytes_to_unicode, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # only for an HF tokenizer: transformers is in

    return {c: b for b, c in bytes_to_unicode().items()}


def split_pattern(pre: Optional[dict[str, Any]]) -> Optional[str]:
    pre = pre or {}
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2:  # Llama-3: Split(pattern, Isolated) then ByteLevel(use_regex=false)
        split, byte_level = steps
        if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
                and "Regex" in split.get("pattern", {}) and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("use_regex", True) and not byte_level.get("add_prefix_space")):
            return split["pattern"]["Regex"]
    return None


def tiktoken_encoding(backend_json: str):
    """A tiktoken.Encoding equivalent to this tokenizer.json, or None (tiktoken absent or not the plain shape)."""
    try:
        import tiktoken
    except ImportError:
        return None
    spec = json.loads(backend_json)
    model = spec.get("model", {})
    if (spec.get("normalizer") or model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback")
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    pattern = split_pattern(spec.get("pre_tokenizer"))
    added = spec.get("added_tokens", [])
    if pattern is None or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    decoder = byte_decoder()
    special = {t["content"]: t["id"] for t in added}
    vocab = model["vocab"]
    try:
        ranks = {bytes(decoder[c] for c in token): i for token, i in vocab.items() if token not in special}
        merged = [vocab["".join(m.split(" ") if isinstance(m, str) else m)] for m in model.get("merges", [])]
    except KeyError:  # a token outside the byte alphabet, or a merge whose result is not in the vocabulary
        return None
    if len(ranks) != len(vocab) - len(set(special) & set(vocab)) or not all(bytes([b]) in ranks for b in range(256)):
        return None
    # Non-decreasing, not strictly increasing: files converted from tiktoken (Llama-3's, by transformers'
    # TikTokenConverter) list every split of a token as its own merge, so one result id repeats.
    if any(a > b for a, b in zip(merged, merged[1:])):
        return None
    try:
        return tiktoken.Encoding("nanopt-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except Exception:  # e.g. overlapping ids: not an equivalent we can build
        return None
