"""Tokenizer files for the embedded corpus, and Megatron's tokenizers over local files.

Tokenizers:
- GPT: the exact GPT-2 byte-level BPE. `openai-whisper`'s sdist ships `gpt2.tiktoken` (base64
  token bytes and rank, rank == GPT-2 token id); `vocab.json` is the byte-to-unicode rendering of
  those tokens plus `<|endoftext|>` = 50256, and `merges.txt` is recovered by BPE-encoding each
  token with the ranks below its own, which must leave exactly two parts: the merged pair.
- BERT: a lower-case WordPiece vocabulary trained here on the corpus by a deterministic
  BPE-style trainer (the `tokenizers` package's WordPiece trainer gives a different vocabulary
  from run to run, so it is only used for BERT's normalisation and pre-tokenisation).

Both are loaded as Megatron-Core's own tokenizer classes (`GPTTokenizer` / `BertTokenizer` from
`megatron.core.tokenizers`) over its HuggingFace library wrapper, which needs `transformers`.
Megatron-Core 0.16.1 maps `GPT2BPETokenizer` / `BertWordPieceLowerCase` to its "megatron"
library, which resolves the hub names "gpt2" / "bert-large-uncased" and hands the vocab file in
as the merges file, so it cannot load local files offline; `build_tokenizer` therefore points
the same Megatron classes at a local directory holding the files.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

from megatron_patches.data.common import CorpusError, install_atomically

GPT2_VOCAB_SIZE = 50257
ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 50256

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Small enough for CPU-sized models, large enough that common words are single pieces.
BERT_VOCAB_SIZE = 8192

TOKENIZER_TYPES = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE rebuilt from tiktoken ranks
# ---------------------------------------------------------------------------------------------

def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token bytes) rank` per line."""
    ranks = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ValueError(
                f"{path}:{line_no}: expected `base64token rank`, got {line[:60]!r}"
            ) from None
    return ranks


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to write BPE tokens as text.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to
    U+0100 onwards (so a space is written as 'Ġ' = U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
    return mapping


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """BPE-encode `token` greedily (lowest-rank adjacent pair first) using ranks < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_at = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def recover_bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order, that reproduces mergeable `ranks`.

    Ranks 0..255 must be the single bytes; the token of rank r >= 256 is the merge of the
    two parts that BPE with ranks < r leaves from its bytes.
    """
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    if [rank for _, rank in ordered] != list(range(len(ordered))):
        raise ValueError("BPE ranks must be exactly 0..N-1")
    if any(len(token) != 1 for token, _ in ordered[:256]):
        raise ValueError("BPE ranks 0..255 must be the 256 single bytes")
    merges = []
    for token, rank in ordered[256:]:
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(
                f"token of rank {rank} ({token!r}) splits into {len(parts)} parts with lower "
                "ranks, expected 2: the ranks are not a BPE merge list"
            )
        merges.append((parts[0], parts[1]))
    return merges


def write_gpt2_vocab_and_merges(tiktoken_path: Path, out_dir: Path) -> tuple[Path, Path]:
    """Write GPT-2's `vocab.json` (token -> id, with <|endoftext|> = 50256) and `merges.txt`."""
    ranks = load_tiktoken_ranks(tiktoken_path)
    if len(ranks) != ENDOFTEXT_ID:
        raise ValueError(
            f"{tiktoken_path} has {len(ranks)} tokens; GPT-2's file has {ENDOFTEXT_ID} "
            "(ids 0..50255, <|endoftext|> is added here)"
        )
    as_text = gpt2_bytes_to_unicode()

    def render(token: bytes) -> str:
        return "".join(as_text[b] for b in token)

    vocab = {render(token): rank for token, rank in ranks.items()}
    vocab[ENDOFTEXT] = ENDOFTEXT_ID
    if len(vocab) != GPT2_VOCAB_SIZE:
        raise ValueError(
            f"{tiktoken_path}: tokens render to {len(vocab)} distinct strings, "
            f"expected {GPT2_VOCAB_SIZE}"
        )
    merges = recover_bpe_merges(ranks)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = out_dir / "vocab.json", out_dir / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text(
        "#version: 0.2\n" + "".join(f"{render(a)} {render(b)}\n" for a, b in merges),
        encoding="utf-8",
    )
    return vocab_path, merges_path


# ---------------------------------------------------------------------------------------------
# Deterministic WordPiece vocabulary for BERT
# ---------------------------------------------------------------------------------------------

def _bert_words(texts: Iterable[str]) -> Counter:
    """Word counts after BERT's lower-casing normaliser and pre-tokeniser (as used at encode time)."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    pre_tokenizer = BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


def train_wordpiece_vocab(
    texts: Iterable[str], vocab_size: int = BERT_VOCAB_SIZE, min_frequency: int = 2
) -> list[str]:
    """A WordPiece vocabulary (special tokens, alphabet, then merged pieces in merge order).

    Words start as characters, non-initial ones written with BERT's "##" continuation prefix;
    the most frequent adjacent pair is merged repeatedly (ties: the lexicographically smallest
    pair), as HF's WordPiece trainer does, but with a fixed tie order so the result is the same
    on every run and machine.
    """
    word_counts = _bert_words(texts)
    words = sorted(word_counts)
    counts_W = [word_counts[w] for w in words]
    pieces_W = [[w[0], *("##" + c for c in w[1:])] for w in words]
    alphabet = sorted({piece for pieces in pieces_W for piece in pieces})
    vocab = [*BERT_SPECIAL_TOKENS, *alphabet]
    if len(vocab) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the {len(vocab)} special tokens and "
            "characters of the corpus"
        )
    known = set(vocab)
    pair_count: dict[tuple[str, str], int] = defaultdict(int)
    pair_words: dict[tuple[str, str], set[int]] = defaultdict(set)
    for w, pieces in enumerate(pieces_W):
        for pair in zip(pieces, pieces[1:]):
            pair_count[pair] += counts_W[w]
            pair_words[pair].add(w)
    # Max-heap by count, then smallest pair; entries go stale when counts change and are skipped.
    heap = [(-count, pair) for pair, count in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_count.get(pair) != -neg_count:
            continue
        if -neg_count < min_frequency:
            break
        first, second = pair
        merged = first + second[2:]
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        touched = set()
        for w in sorted(pair_words.pop(pair)):
            old = pieces_W[w]
            new: list[str] = []
            i = 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == first and old[i + 1] == second:
                    new.append(merged)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            for p in zip(old, old[1:]):
                pair_count[p] -= counts_W[w]
                pair_words[p].discard(w)
                touched.add(p)
            for p in zip(new, new[1:]):
                pair_count[p] += counts_W[w]
                pair_words[p].add(w)
                touched.add(p)
            pieces_W[w] = new
        for p in touched:
            if pair_count[p] > 0:
                heapq.heappush(heap, (-pair_count[p], p))
            else:
                del pair_count[p]
                pair_words.pop(p, None)
    return vocab


# ---------------------------------------------------------------------------------------------
# Megatron tokenizers
# ---------------------------------------------------------------------------------------------

_VERY_LARGE_LENGTH = int(1e30)  # transformers' "no maximum" model_max_length


def _tokenizer_files(tokenizer_type: str, vocab_file: Path, merge_file: Path | None):
    """The files and tokenizer_config.json of a local HF tokenizer directory for this type."""
    if tokenizer_type == "GPT2BPETokenizer":
        if merge_file is None:
            raise ValueError("tokenizer type GPT2BPETokenizer needs a merge file (--merge-file)")
        files = {"vocab.json": vocab_file, "merges.txt": merge_file}
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT,
            "add_prefix_space": False,
        }
    elif tokenizer_type == "BertWordPieceLowerCase":
        files = {"vocab.txt": vocab_file}
        config = {
            "tokenizer_class": "BertTokenizer", "do_lower_case": True,
            "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
            "cls_token": "[CLS]", "mask_token": "[MASK]",
        }
    else:
        raise ValueError(
            f"tokenizer type {tokenizer_type!r} is not supported here; "
            f"valid: {sorted(set(TOKENIZER_TYPES.values()))}"
        )
    config["model_max_length"] = _VERY_LARGE_LENGTH
    return files, config


def _staged_tokenizer_dir(tokenizer_type: str, vocab_file: Path, merge_file: Path | None) -> Path:
    """A directory in the standard HF layout with copies of the given files.

    Its name is a digest of the contents and settings, so the same files always give the same
    path: Megatron hashes the tokenizer path into its dataset-index cache keys.
    """
    files, config = _tokenizer_files(tokenizer_type, vocab_file, merge_file)
    digest = hashlib.sha256(json.dumps([tokenizer_type, config], sort_keys=True).encode())
    for name, path in sorted(files.items()):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{tokenizer_type} {name} file {path} does not exist")
        digest.update(name.encode() + b"\0" + Path(path).read_bytes())
    root = Path(tempfile.gettempdir()) / f"megatron_patches_tokenizers-{os.getuid()}"
    target = root / f"{tokenizer_type}-{digest.hexdigest()[:16]}"
    if not (target / "tokenizer_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        for name, path in files.items():
            shutil.copyfile(path, staging / name)
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        install_atomically(staging, target)
    return target


def build_tokenizer(tokenizer_type: str, vocab_file: str | Path, merge_file: str | Path | None):
    """Megatron-Core's tokenizer object for `--tokenizer-type` with local vocab/merge files.

    Returns `megatron.core.tokenizers` GPTTokenizer (GPT2BPETokenizer) or BertTokenizer
    (BertWordPieceLowerCase); needs the `transformers` package.
    """
    directory = _staged_tokenizer_dir(
        tokenizer_type, Path(vocab_file), Path(merge_file) if merge_file is not None else None
    )
    # Megatron's HF wrapper imports transformers softly and fails later with a vaguer error.
    if importlib.util.find_spec("transformers") is None:
        raise CorpusError(
            f"Megatron's {tokenizer_type} tokenizer needs the `transformers` package: "
            "pip install transformers"
        )
    from megatron.core.tokenizers import MegatronTokenizer

    model_type = "gpt" if tokenizer_type == "GPT2BPETokenizer" else "bert"
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(directory),
        metadata_path={"library": "huggingface", "model_type": model_type},
        use_fast=True,
    )
