"""Training data: the embedded real-text corpus, tokenizers and Megatron datasets.

- `corpus`: Jane Austen's novels prepared offline into Megatron indexed datasets (sources,
  chapters, the GPT-2 BPE and BERT WordPiece tokenizer files, the cache); `tools/prepare_data.py`
  and the training script's default data.
- `datasets`: Megatron's tokenizer for --tokenizer-type, the train/validation datasets of
  --data-path / --mock-data / the embedded corpus, and the per-rank micro-batch iterators.

Nothing here knows about MoE modes; the training loop (training/loop.py) calls `datasets`.
"""
