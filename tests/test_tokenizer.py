"""The tokenizer and its tiktoken engine (fastbpe): batch encoding gives transformers' ids for GPT-2- and Llama-3-shaped
byte-level BPEs, an engine that disagrees is dropped, others keep transformers', a damaged directory: one paragraph."""
from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

import numpy as np
import pytest
from conftest import PREPARE_DOCS
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from nanopt.config import ConfigError
from nanopt.data import shards
from nanopt.data.fastbpe import byte_decoder, tiktoken_encoding
from nanopt.data.tokenizer import get_tokenizer


def test_encode_documents_matches_one_document_at_a_time(tokenizer_dir):
    tok, texts = get_tokenizer(str(tokenizer_dir)), ["", "a b", PREPARE_DOCS[3], "", "🦊"]
    for bos, eos in ((None, None), (tok.bos_id, None), (None, tok.eos_id), (tok.bos_id, tok.eos_id)):
        lengths, flat = shards.encode_documents(tok, texts, bos, eos)
        ref = [([bos] if bos is not None else []) + tok.encode(t) + ([eos] if eos is not None else []) for t in texts]
        assert lengths.tolist() == [len(r) for r in ref]
        assert flat.tolist() == [i for r in ref for i in r]


def _batch(tok, texts: list[str]) -> list[list[int]]:
    return [a.tolist() for a in tok.encode_batch_arrays(texts)]


def _same_ids_on_tiktoken(tok, texts: list[str]) -> list[list[int]]:
    ids = _batch(tok, texts)
    assert type(tok._tiktoken).__module__.startswith("tiktoken")  # the fast engine is really in use
    assert ids == [tok.hf.encode(t, add_special_tokens=False) for t in texts]
    return ids


def test_batch_encode_on_tiktoken_gives_transformers_ids_and_an_engine_that_disagrees_is_dropped(tokenizer_dir,
                                                                                                  caplog):
    tok = get_tokenizer(str(tokenizer_dir))  # a fresh one: its engine is chosen on the first batch
    texts = [*PREPARE_DOCS, "a literal <s> and </s> inside text", "  leading spaces\n\n\ttabs  ", "'s 're 1234 🦊🦊"]
    ids = _same_ids_on_tiktoken(tok, texts)
    assert _batch(tok, texts[::-1]) == ids[::-1]  # and stays equal after the first-batch check
    tok = get_tokenizer(str(tokenizer_dir))
    tok._tiktoken = SimpleNamespace(encode_to_numpy=lambda text, allowed_special=(): np.full(len(text), 3, np.uint32))
    with caplog.at_level("WARNING", logger="nanopt"):
        assert _batch(tok, PREPARE_DOCS[:5]) == [tok.hf.encode(t, add_special_tokens=False) for t in PREPARE_DOCS[:5]]
    assert tok._tiktoken is False and "disagrees" in caplog.text


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_TEXTS = PREPARE_DOCS + ["12345 numbers\r\nCRLF  <|begin_of_text|>  x", "DON'T 'S"]
ALPHABET = pre_tokenizers.ByteLevel.alphabet()


def test_llama3_shaped_tokenizers_also_run_on_tiktoken_with_the_same_ids(tmp_path):
    """Llama-3's tokenizer.json shape: Split(regex, Isolated) + ByteLevel(use_regex=false), ignore_merges. And as
    Llama-3's came, from tiktoken ranks through transformers' TikTokenConverter, which writes one merge per split of
    each token, so merge results repeat: the engine must still be used."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    bpe = Tokenizer(models.BPE(ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(PREPARE_DOCS, trainers.BpeTrainer(vocab_size=500, special_tokens=["<|begin_of_text|>"],
                                                              initial_alphabet=ALPHABET))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>").save_pretrained(tmp_path / "split")
    _same_ids_on_tiktoken(get_tokenizer(str(tmp_path / "split")), LLAMA3_TEXTS)
    bpe = Tokenizer(models.BPE())  # the ranks to convert
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(PREPARE_DOCS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=ALPHABET))
    to_byte = byte_decoder()
    ranks = sorted((i, bytes(to_byte[c] for c in token)) for token, i in bpe.get_vocab().items())
    (tmp_path / "ranks.tiktoken").write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for i, b in ranks))
    converted = TikTokenConverter(vocab_file=str(tmp_path / "ranks.tiktoken"), pattern=LLAMA3_SPLIT,
                                  extra_special_tokens=["<|begin_of_text|>"]).converted()
    model = json.loads(converted.to_str())["model"]
    results = [model["vocab"]["".join(m) if isinstance(m, list) else m.replace(" ", "")] for m in model["merges"]]
    assert any(a == b for a, b in zip(results, results[1:]))  # the Llama-3 shape: repeated merge results
    PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|begin_of_text|>").save_pretrained(tmp_path / "tok")
    _same_ids_on_tiktoken(get_tokenizer(str(tmp_path / "tok")), LLAMA3_TEXTS + ["aaaa bbbbbb\n\n\t  ccc"])


@pytest.mark.parametrize("files, words", [
    ({"tokenizer.json": "garbage"}, ["JSONDecodeError"]),
    ({"tokenizer.json": "{}", "tokenizer_config.json": '{"x": 1}'}, ["KeyError", "added_tokens"]),  # was a traceback
    ({}, ["Couldn't instantiate the backend tokenizer"]),  # transformers' message spans lines: one paragraph here
])
def test_a_damaged_tokenizer_directory_is_one_paragraph_naming_it(tmp_path, files, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        get_tokenizer(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and f"`data.tokenizer` '{tmp_path}' cannot be loaded" in message, message
    assert all(word in message for word in words), message


def test_tokenizers_that_are_not_plain_byte_level_bpe_keep_the_transformers_engine():
    wl = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tiktoken_encoding(wl.to_str()) is None
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.normalizer = normalizers.NFKC()  # tiktoken has no normaliser
    assert tiktoken_encoding(bpe.to_str()) is None
