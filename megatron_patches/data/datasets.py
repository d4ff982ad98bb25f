"""Tokenizer, datasets and per-rank micro-batch iterators, built from Megatron-Core parts.

Every rank reads the dataset itself (no broadcast): ranks of one data-parallel replica (its
TP and PP ranks) draw the same sample indices, different replicas draw disjoint ones, in
the order of Megatron-LM's pretraining sampler, so `consumed_samples` fully describes the
position in the data and a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

import torch

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

from megatron_patches.data import corpus, tokenizers


def build_tokenizer(args):
    """Megatron's tokenizer for `--tokenizer-type`.

    GPT2BPETokenizer and BertWordPieceLowerCase are built from the given local vocab/merge
    files (Megatron's own builder would fetch "gpt2"/"bert" from the HuggingFace hub, which
    offline machines cannot reach and which would ignore --vocab-file); every other type goes
    through the same builder Megatron-LM uses.
    """
    if args.tokenizer_type in ("GPT2BPETokenizer", "BertWordPieceLowerCase") and args.vocab_file:
        return tokenizers.build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    namespace = SimpleNamespace(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        tokenizer_model=args.tokenizer_model,
        tokenizer_metadata=args.tokenizer_metadata,
        tokenizer_special_tokens=args.tokenizer_special_tokens,
        tokenizer_hf_use_fast=args.tokenizer_hf_use_fast,
        tokenizer_hf_include_special_tokens=args.tokenizer_hf_include_special_tokens,
        tokenizer_sentencepiece_legacy=args.tokenizer_sentencepiece_legacy,
        trust_remote_code=args.trust_remote_code,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
    )
    return megatron_build_tokenizer(namespace)


def _data_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's --data-path forms: `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...`."""
    if len(data_path) == 1:
        return data_path, None
    weights = [float(w) for w in data_path[0::2]]
    return list(data_path[1::2]), weights


def check_split_documents(prefixes: list[str], split: str) -> None:
    """Every split with a nonzero share must get at least one document of every prefix.

    Megatron rounds split boundaries to whole documents; an empty split that is asked for
    samples makes GPTDataset._get_num_epochs loop forever, so refuse it up front.
    """
    shares = parse_and_normalize_split(split)
    for prefix in prefixes:
        documents = IndexedDataset(prefix).document_indices.shape[0] - 1
        counts = corpus.split_document_counts(split, documents)
        for name, share, count in zip(("train", "validation", "test"), shares, counts):
            if share > 0 and count == 0:
                raise ValueError(
                    f"--split {split}: the {name} split of {prefix} gets 0 of its {documents} documents; "
                    f"give it a larger share or 0 (e.g. --split 949,51,0)"
                )


def build_datasets(args, tokenizer):
    """(train, valid, test) Megatron datasets sized for the whole run."""
    train_samples = args.train_iters * args.global_batch_size
    eval_runs = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    eval_samples = eval_runs * args.eval_iters * args.global_batch_size
    sizes = [train_samples, eval_samples, args.eval_iters * args.global_batch_size]
    blend = None if args.mock_data else _data_blend(args.data_path)
    if blend is not None:
        check_split_documents(blend[0], args.split)
    if args.model_family == "gpt":
        config = GPTDatasetConfig(
            random_seed=args.seed,
            sequence_length=args.seq_length,
            blend=blend,
            split=args.split,
            tokenizer=tokenizer,
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss,
            create_attention_mask=args.create_attention_mask_in_dataloader,
            mmap_bin_files=args.mmap_bin_files,
            mid_level_dataset_surplus=0.005,
            path_to_cache=args.data_cache_path,
        )
        dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    else:
        config = BERTMaskedWordPieceDatasetConfig(
            random_seed=args.seed,
            sequence_length=args.seq_length,
            blend=blend,
            split=args.split,
            tokenizer=tokenizer,
            masking_probability=0.15,
            short_sequence_probability=0.1,
            masking_max_ngram=3,
            masking_do_full_word=True,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            path_to_cache=args.data_cache_path,
            masking_use_geometric_distribution=False,
            classification_head=args.bert_binary_head,
            mmap_bin_files=args.mmap_bin_files,
            mid_level_dataset_surplus=0.005,
        )
        dataset_class = BERTMaskedWordPieceDataset
    return BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()


@dataclass
class BatchIterator:
    """Micro-batches of one data-parallel rank, in Megatron-LM's pretraining-sampler order.

    Global sample indices advance by micro_batch_size x dp_size per micro-batch step; this
    rank takes its contiguous micro_batch_size slice of each step.
    """

    dataset: object
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    consumed_samples: int = 0

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        indices = [(start + i) % len(self.dataset) for i in range(self.micro_batch_size)]
        self.consumed_samples += step
        samples = [self.dataset[i] for i in indices]
        return {key: torch.utils.data.default_collate([s[key] for s in samples]) for key in samples[0]}


class _ChunkView:
    """One model chunk's iterator over micro-batches shared by every chunk (`chunk_iterators`)."""

    def __init__(self, shared: "_SharedMicroBatches", chunk: int):
        self.shared, self.chunk = shared, chunk

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        return self.shared.read(self.chunk)


class _SharedMicroBatches:
    def __init__(self, source: Iterator[dict], chunks: int):
        self.source, self.chunks = source, chunks
        self.reads = [0] * chunks
        self.pending: dict[int, list] = {}  # micro-batch index -> [batch, chunks yet to read it]

    def read(self, chunk: int) -> dict:
        index = self.reads[chunk]
        if index not in self.pending:
            self.pending[index] = [next(self.source), self.chunks]
        entry = self.pending[index]
        entry[1] -= 1
        if entry[1] == 0:
            del self.pending[index]
        self.reads[chunk] += 1
        return entry[0]


def chunk_iterators(source: Iterator[dict], chunks: int) -> list[Iterator[dict]]:
    """Megatron's interleaved schedule calls each model chunk's forward step with that chunk's own
    iterator, once per micro-batch, in its own order (Megatron-LM builds one data iterator per
    chunk over the same samples): `chunks` iterators that each yield `source`'s micro-batches in
    order, each micro-batch read from `source` once, when the first chunk reaches it, and
    dropped when every chunk has had it."""
    shared = _SharedMicroBatches(source, chunks)
    return [_ChunkView(shared, chunk) for chunk in range(chunks)]


def gpt_batch(batch: dict) -> dict:
    """The model inputs of a GPTDataset micro-batch ([b, s] tensors)."""
    return {
        "tokens": batch["tokens"].long(),
        "labels": batch["labels"].long(),
        "loss_mask": batch["loss_mask"].float(),
        "position_ids": batch["position_ids"].long(),
        "attention_mask": batch.get("attention_mask"),
    }


def bert_batch(batch: dict) -> dict:
    """The model inputs of a BERT masked-LM micro-batch ([b, s] tensors)."""
    return {
        "tokens": batch["text"].long(),
        "types": batch["types"].long(),
        "labels": batch["labels"].long(),
        "is_random": batch["is_random"].long(),
        "padding_mask": batch["padding_mask"].long(),
        "loss_mask": batch["loss_mask"].float(),
    }
