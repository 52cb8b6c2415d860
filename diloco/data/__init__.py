"""Data for demos, tests and benchmarks: text found on the machine, nothing downloaded."""

from diloco.data.corpus import (
    DEFAULT_MAX_BYTES,
    MIN_CORPUS_BYTES,
    VOCAB_SIZE,
    BatchSampler,
    Corpus,
    CorpusError,
    decode,
    derive_seed,
    encode,
    load_stdlib_text,
    load_text,
    make_shards,
    split_train_eval,
    stdlib_source_files,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MIN_CORPUS_BYTES",
    "VOCAB_SIZE",
    "BatchSampler",
    "Corpus",
    "CorpusError",
    "decode",
    "derive_seed",
    "encode",
    "load_stdlib_text",
    "load_text",
    "make_shards",
    "split_train_eval",
    "stdlib_source_files",
]
