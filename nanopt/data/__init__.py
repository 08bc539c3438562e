"""Data: documents -> tokenizer -> token shards."""
