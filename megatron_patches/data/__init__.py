"""Training data: the embedded real-text corpus, tokenizers and Megatron datasets.

- `corpus`: Jane Austen's novels prepared offline into Megatron indexed datasets (sources,
  chapters and sentences, the indexed files, the cache); `tools/prepare_data.py` and the
  training script's default data;
- `rdata`: the reader of R's serialized data the novels ship in;
- `tokenizers`: the GPT-2 BPE files rebuilt from tiktoken ranks, the deterministic BERT
  WordPiece vocabulary, Megatron's tokenizer classes over local files;
- `common`: the error type, progress log and atomic installs the above share.
- `datasets`: Megatron's tokenizer for --tokenizer-type, the train/validation datasets of
  --data-path / --mock-data / the embedded corpus, and the per-rank micro-batch iterators.
- `index_check`: the up-front check of an indexed dataset's files (magic, version, sizes),
  run by the flag validation before any process group.

Nothing here knows about MoE modes; the training loop (training/loop.py) calls `datasets`.
"""
