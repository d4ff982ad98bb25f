"""The offline corpus: R data reader, chapters/sentences, GPT-2 BPE rebuild, WordPiece, Megatron
indexed datasets and dataset builders, the cache and its failure messages.

Uses the real sources (Debian r-cran-janeaustenr, the openai-whisper sdist) in the default
cache directory: the first run downloads them and builds the full GPT corpus (once), later runs
reuse it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import regex
import torch

from megatron_patches.data import corpus, rdata, tokenizers
from megatron_patches.data.corpus import (
    CorpusError,
    austen_chapters,
    default_cache_dir,
    ensure_default_corpus,
    prepare_corpus,
    split_document_counts,
    split_sentences,
)
from megatron_patches.data.rdata import RVector, unserialize_r
from megatron_patches.data.tokenizers import build_tokenizer, recover_bpe_merges, train_wordpiece_vocab

REPO = Path(__file__).resolve().parents[1]
BERT_SLICE = 12  # chapters in the BERT test slice


@pytest.fixture(scope="module")
def sources() -> Path:
    path = default_cache_dir() / "sources"
    corpus.fetch_austen_package(path)
    corpus.fetch_gpt2_tiktoken(path)
    return path


@pytest.fixture(scope="module")
def chapters(sources):
    return austen_chapters(sources)


@pytest.fixture(scope="module")
def gpt_full():
    return ensure_default_corpus("gpt")


@pytest.fixture(scope="module")
def gpt_tokenizer(gpt_full):
    return build_tokenizer(gpt_full.tokenizer_type, gpt_full.vocab_file, gpt_full.merge_file)


@pytest.fixture(scope="module")
def bert_slice():
    return ensure_default_corpus("bert", max_documents=BERT_SLICE)


@pytest.fixture(scope="module")
def bert_tokenizer(bert_slice):
    return build_tokenizer(bert_slice.tokenizer_type, bert_slice.vocab_file, bert_slice.merge_file)


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    """Megatron's BERT dataset asks torch.distributed for the rank: a world of one."""
    if torch.distributed.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


# --- R serialization -------------------------------------------------------------------------

def _xdr(*ints: int) -> bytes:
    return struct.pack(f">{len(ints)}i", *ints)


def _charsxp(text: str) -> bytes:
    raw = text.encode()
    return _xdr(9 | (1 << 3) << 12, len(raw)) + raw  # CHARSXP flagged UTF-8


def test_unserialize_hand_built_stream():
    """list(c(x = "Emma", y = NA), c(a = 7L, b = NA)): names' tag is a symbol the first time and
    a back-reference (REFSXP, index 1) the second time, as R writes it."""
    has_attr, has_tag = 1 << 9, 1 << 10
    names_symbol = _xdr(1) + _charsxp("names")
    stream = (
        b"X\n" + _xdr(3, 0x040201, 0x030500, 5) + b"UTF-8"
        + _xdr(19, 2)                                          # VECSXP of length 2
        + _xdr(16 | has_attr, 2) + _charsxp("Emma") + _xdr(9, -1)   # STRSXP "Emma", NA
        + _xdr(2 | has_tag) + names_symbol                     # attributes: names = c("x", "y")
        + _xdr(16, 2) + _charsxp("x") + _charsxp("y") + _xdr(254)
        + _xdr(13 | has_attr, 2, 7, -(2**31))                  # INTSXP 7L, NA
        + _xdr(2 | has_tag, (1 << 8) | 255)                    # names again, tag = ref #1
        + _xdr(16, 2) + _charsxp("a") + _charsxp("b") + _xdr(254)
    )
    value = unserialize_r(stream)
    assert value == [["Emma", None], [7, None]]
    assert value[0].named() == {"x": "Emma", "y": None}
    assert value[1].named() == {"a": 7, "b": None}
    assert value.attributes == {}


def test_unserialize_rejects_other_formats_and_types():
    with pytest.raises(ValueError, match="not an XDR"):
        unserialize_r(b"A\n3\n")
    closure = b"X\n" + _xdr(2, 0, 0) + _xdr(3)
    with pytest.raises(ValueError, match="type code 3 "):
        unserialize_r(closure)
    with pytest.raises(ValueError, match="no matching names"):
        RVector([1, 2]).named()


def test_reads_the_real_janeaustenr_database(sources):
    objects = rdata.read_r_lazyload_db(sources / "janeaustenr" / "data" / "Rdata")
    assert sorted(objects) == sorted(name for name, _ in corpus.AUSTEN_NOVELS)
    first_lines = {name: lines[0] for name, lines in objects.items()}
    assert first_lines == {
        "sensesensibility": "SENSE AND SENSIBILITY", "prideprejudice": "PRIDE AND PREJUDICE",
        "mansfieldpark": "MANSFIELD PARK", "emma": "EMMA",
        "northangerabbey": "NORTHANGER ABBEY", "persuasion": "Persuasion",
    }
    for lines in objects.values():
        assert all(isinstance(line, str) for line in lines)
        assert max(map(len, lines)) < 120  # Project Gutenberg lines of ~70 characters
    # The package's own test: Persuasion has fewer lines than Emma.
    assert len(objects["persuasion"]) < len(objects["emma"])


def test_missing_database_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="Rdata.rdx"):
        corpus.read_austen_novels(tmp_path)


# --- chapters and sentences ------------------------------------------------------------------

def test_chapters_match_the_novels(chapters):
    per_novel = {title: sum(c.novel == title for c in chapters) for _, title in corpus.AUSTEN_NOVELS}
    assert per_novel == {
        "Sense & Sensibility": 50, "Pride & Prejudice": 61, "Mansfield Park": 48,
        "Emma": 55, "Northanger Abbey": 31, "Persuasion": 24,
    }
    openings = {
        "Sense & Sensibility": "The family of Dashwood had long been settled in Sussex.",
        "Pride & Prejudice": "It is a truth universally acknowledged, that a single man in "
        "possession of a good fortune, must be in want of a wife.",
        "Mansfield Park": "About thirty years ago Miss Maria Ward, of Huntingdon,",
        "Emma": "Emma Woodhouse, handsome, clever, and rich,",
        "Northanger Abbey": "No one who had ever seen Catherine Morland in her infancy",
        "Persuasion": "Sir Walter Elliot, of Kellynch Hall, in Somersetshire,",
    }
    for title, opening in openings.items():
        first = next(c for c in chapters if c.novel == title)
        assert first.sentences[0].startswith(opening), (title, first.sentences[0])
        assert first.text.startswith(first.heading + "\n\n")
    for chapter in chapters:
        assert corpus._CHAPTER_HEADING.match(chapter.heading)
        assert not any(p.strip().upper() in {"THE END", "FINIS", "A NOTE ON THE TEXT"}
                       for p in chapter.paragraphs)
        assert "\n" not in "".join(chapter.paragraphs)


def test_split_sentences_worked_example():
    paragraph = ('"I understand you.--You do not. Mr. Darcy came! "Is it?" said he. '
                 "E. Gardiner wrote. Well!--and so. _She_ did.")
    assert split_sentences(paragraph) == [
        '"I understand you.', "You do not.", "Mr. Darcy came!", '"Is it?" said he.',
        "E. Gardiner wrote.", "Well!--and so.", "_She_ did.",
    ]


# --- GPT-2 BPE -------------------------------------------------------------------------------

def test_recover_merges_worked_example():
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"ab": 256, b"abc": 257, b"cab": 258})
    assert recover_bpe_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"c", b"ab")]
    ranks[b"xyz"] = 259  # no lower-ranked pair makes it: three parts
    with pytest.raises(ValueError, match="rank 259"):
        recover_bpe_merges(ranks)


def test_gpt2_vocab_and_merges_facts(gpt_full):
    vocab = json.loads(gpt_full.vocab_file.read_text(encoding="utf-8"))
    assert len(vocab) == 50257 and sorted(vocab.values()) == list(range(50257))
    # Well-known GPT-2 ids.
    known = {"<|endoftext|>": 50256, "Hello": 15496, "Ġworld": 995, "Ġthe": 262, "The": 464,
             "ĠThe": 383, ",": 11, ".": 13, "Ċ": 198, "ĊĊ": 628, "Ġt": 256, "!": 0}
    assert {token: vocab[token] for token in known} == known
    lines = gpt_full.merge_file.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2" and len(lines) == 50001
    assert lines[1:8] == ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he"]
    # Every merge is of two known tokens into the token whose id is 256 + its line number.
    ids = {token: i for token, i in vocab.items()}
    for line_no, line in enumerate(lines[1:]):
        first, second = line.split(" ")
        assert first in ids and second in ids and ids[first + second] == 256 + line_no
    mapping = tokenizers.gpt2_bytes_to_unicode()
    assert len(set(mapping.values())) == 256 and all(ch.isprintable() for ch in mapping.values())


GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def _rank_bpe_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """GPT-2 encoding straight from tiktoken ranks (tiktoken's algorithm): split with GPT-2's
    pattern, then in each piece merge the lowest-ranked adjacent pair until none is left."""
    ids = []
    for piece in GPT2_PATTERN.findall(text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:
            candidates = [(ranks.get(a + b, 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(candidates, default=(1 << 30, -1))
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def test_megatron_gpt2_tokenizer_equals_tiktoken_ranks(gpt_tokenizer, chapters, sources):
    assert type(gpt_tokenizer).__name__ == "GPTTokenizer"  # megatron.core.tokenizers' class
    assert gpt_tokenizer.vocab_size == 50257 and gpt_tokenizer.eod == 50256
    assert gpt_tokenizer.tokenize("Hello world") == [15496, 995]
    ranks = tokenizers.load_tiktoken_ranks(sources / "gpt2.tiktoken")
    for chapter in chapters[::27]:  # ten chapters across all six novels
        ids = gpt_tokenizer.tokenize(chapter.text)
        assert ids == _rank_bpe_encode(chapter.text, ranks)
        assert gpt_tokenizer.detokenize(ids) == chapter.text


def test_gpt_indexed_dataset_reads_back_the_tokenized_chapters(gpt_full, gpt_tokenizer, chapters):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert gpt_full.num_documents == len(chapters) == 269
    dataset = IndexedDataset(str(gpt_full.data_prefix))
    assert len(dataset) == 269
    assert list(dataset.document_indices) == list(range(270))  # one sequence per chapter
    assert int(dataset.sequence_lengths.sum()) == gpt_full.num_tokens
    assert dataset[0].dtype == numpy.uint16
    for i in [0, 1, 100, 200, 268]:
        expected = gpt_tokenizer.tokenize(chapters[i].text) + [50256]
        assert dataset[i].tolist() == expected


def test_split_document_counts_follow_megatron_rounding():
    assert split_document_counts("949,50,1", 269) == (255, 14, 0)
    assert split_document_counts("90,5,5", 269) == (242, 14, 13)
    assert split_document_counts("80,10,10", BERT_SLICE) == (10, 1, 1)


def test_gpt_dataset_builds_splits(gpt_full, gpt_tokenizer, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    def build(split, sizes, seq_length):
        config = GPTDatasetConfig(
            random_seed=1234, sequence_length=seq_length, blend=([str(gpt_full.data_prefix)], None),
            split=split, tokenizer=gpt_tokenizer, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path / split),
        )
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()

    # Megatron-LM's default style split: no test documents, so no test samples may be asked for.
    train, valid, test = build("949,50,1", [200, 20, None], 256)
    assert len(train) >= 200 and len(valid) >= 20 and len(test) == 0
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == (256,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["loss_mask"].sum()) == 256

    splits = build("90,5,5", [16, 8, 8], 64)
    for dataset in splits:
        assert len(dataset) >= 8
        assert dataset[len(dataset) - 1]["tokens"].shape == (64,)
    # The training split never draws from the last 10% of the chapters.
    train_docs = set(splits[0].document_index.tolist())
    assert max(train_docs) < 242 and min(set(splits[2].document_index.tolist())) >= 256


# --- BERT ------------------------------------------------------------------------------------

def test_wordpiece_trainer_worked_example():
    """Words aaab, aab, ab. Pairs: (a,##a) 2, (##a,##a) 1, (##a,##b) 2, (a,##b) 1; the tie at 2
    goes to the smaller pair ("##a" < "a"), so ##ab is merged first; with min_frequency=1 the
    remaining count-1 pairs follow in lexicographic order."""
    base = [*tokenizers.BERT_SPECIAL_TOKENS, "##a", "##b", "a"]
    assert train_wordpiece_vocab(["aaab aab ab"], vocab_size=100, min_frequency=2) == [*base, "##ab"]
    assert train_wordpiece_vocab(["aaab aab ab"], vocab_size=100, min_frequency=1) == [
        *base, "##ab", "##aab", "aaab", "aab", "ab"]
    assert train_wordpiece_vocab(["aaab aab ab"], vocab_size=9, min_frequency=1) == [*base, "##ab"]
    with pytest.raises(ValueError, match="vocab_size=4"):
        train_wordpiece_vocab(["ab"], vocab_size=4)


def test_bert_vocab_and_megatron_tokenizer(bert_slice, bert_tokenizer, chapters):
    pieces = bert_slice.vocab_file.read_text(encoding="utf-8").splitlines()
    assert len(pieces) == len(set(pieces)) == tokenizers.BERT_VOCAB_SIZE
    assert pieces[:5] == list(tokenizers.BERT_SPECIAL_TOKENS)
    assert bert_slice.merge_file is None and bert_slice.tokenizer_type == "BertWordPieceLowerCase"
    assert type(bert_tokenizer).__name__ == "BertTokenizer"  # megatron.core.tokenizers' class
    assert (bert_tokenizer.pad, bert_tokenizer.cls, bert_tokenizer.sep, bert_tokenizer.mask) == (0, 2, 3, 4)
    assert bert_tokenizer.vocab_size == tokenizers.BERT_VOCAB_SIZE
    assert bert_tokenizer.tokenize("ELIZABETH") == bert_tokenizer.tokenize("elizabeth")
    assert bert_tokenizer.detokenize(bert_tokenizer.tokenize("Mr. Darcy")) == "mr. darcy"
    ids = [i for c in chapters[:BERT_SLICE] for s in c.sentences for i in bert_tokenizer.tokenize(s)]
    assert 1 not in ids  # [UNK]: the vocabulary covers its own corpus


def test_bert_indexed_dataset_is_sentences_within_chapters(bert_slice, bert_tokenizer, chapters):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(bert_slice.data_prefix))
    expected = [[bert_tokenizer.tokenize(s) for s in c.sentences] for c in chapters[:BERT_SLICE]]
    boundaries = numpy.cumsum([0] + [len(doc) for doc in expected]).tolist()
    assert dataset.document_indices.tolist() == boundaries
    assert [dataset[i].tolist() for i in range(len(dataset))] == [s for doc in expected for s in doc]
    assert bert_slice.num_tokens == int(dataset.sequence_lengths.sum())


def test_bert_dataset_builds_masked_samples(bert_slice, bert_tokenizer, single_rank_group, tmp_path):
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=128, blend=([str(bert_slice.data_prefix)], None),
        split="80,10,10", tokenizer=bert_tokenizer, path_to_cache=str(tmp_path),
        masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=True,
    )
    splits = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, [32, 4, 4], lambda: True, config
    ).build()
    for dataset in splits:
        assert len(dataset) >= 4
        sample = dataset[0]
        text, padding = sample["text"], sample["padding_mask"]
        assert text.shape == sample["labels"].shape == sample["types"].shape == (128,)
        length = int(padding.sum())
        assert text[0] == bert_tokenizer.cls and text[length - 1] == bert_tokenizer.sep
        assert (text[:length] == bert_tokenizer.sep).sum() == 2  # segments A and B
        masked = sample["loss_mask"].astype(bool)
        assert 0 < masked.sum() <= 0.15 * length + 3
        assert (sample["labels"][~masked] == -1).all() and (sample["labels"][masked] >= 5).all()


# --- cache and errors ------------------------------------------------------------------------

def test_cache_is_reused_and_incomplete_caches_are_rebuilt(tmp_path, sources, gpt_full):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    first = prepare_corpus("gpt", tmp_path, max_documents=2, sources=sources)
    assert first.data_prefix.parent.name == "austen-gpt-v1-first2"
    assert first.num_documents == 2
    full = IndexedDataset(str(gpt_full.data_prefix))
    sliced = IndexedDataset(str(first.data_prefix))
    assert [sliced[i].tolist() for i in range(2)] == [full[i].tolist() for i in range(2)]
    del sliced
    bin_path = Path(f"{first.data_prefix}.bin")
    stamp = bin_path.stat().st_mtime_ns
    assert prepare_corpus("gpt", tmp_path, max_documents=2, sources=sources) == first
    assert bin_path.stat().st_mtime_ns == stamp  # reused, not rewritten

    size = bin_path.stat().st_size
    with open(bin_path, "r+b") as f:  # a half-written .bin
        f.truncate(size // 2)
    leftover = tmp_path / ".austen-gpt-v1-first2.tmp-99999"  # a crashed build
    leftover.mkdir()
    assert prepare_corpus("gpt", tmp_path, max_documents=2, sources=sources) == first
    assert bin_path.stat().st_size == size and not leftover.exists()

    (first.data_prefix.parent / "manifest.json").unlink()
    assert prepare_corpus("gpt", tmp_path, max_documents=2, sources=sources) == first


def test_concurrent_preparers_build_once(tmp_path, sources):
    """Two processes (as torchrun ranks would) ask for the same corpus at the same time."""
    code = (
        "import sys; from megatron_patches.data.corpus import prepare_corpus; "
        "p = prepare_corpus('gpt', sys.argv[1], 1, sources=sys.argv[2]); "
        "print('RESULT', p.data_prefix, p.num_tokens)"
    )
    command = [sys.executable, "-c", code, str(tmp_path), str(sources)]
    runs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    results = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2 and results[0] == results[1]
    assert sum(out.count("preparing the gpt corpus") for out in outputs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".prepare.lock", "austen-gpt-v1-first1"]


def test_missing_apt_get_gives_a_clear_error(tmp_path, monkeypatch):
    if (Path("/") / corpus._R_PACKAGE_SUBDIR).is_dir():
        pytest.skip("janeaustenr is installed system-wide: no download is attempted")
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with pytest.raises(CorpusError) as error:
        ensure_default_corpus("gpt", cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert "apt-get" in message and "not installed" in message
    assert "MEGATRON_PATCHES_DATA" in message
    assert not list((tmp_path / "cache").glob("austen-*"))  # nothing half-built is left


def test_unknown_debian_package_error_carries_apt_stderr(tmp_path):
    with pytest.raises(CorpusError) as error:
        corpus.fetch_austen_package(tmp_path, package="r-cran-no-such-package-for-tests")
    message = str(error.value)
    assert "apt-get download r-cran-no-such-package-for-tests failed" in message
    assert "Unable to locate package" in message and "apt-get update" in message
    assert not (tmp_path / "janeaustenr").exists()


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="family='t5'.*'bert', 'gpt'"):
        ensure_default_corpus("t5")
    with pytest.raises(ValueError, match="max_documents=0"):
        ensure_default_corpus("gpt", max_documents=0)
    with pytest.raises(ValueError, match="'SentencePieceTokenizer'.*valid"):
        build_tokenizer("SentencePieceTokenizer", "vocab.json", None)
    with pytest.raises(ValueError, match="merge file"):
        build_tokenizer("GPT2BPETokenizer", "vocab.json", None)


def test_prepare_data_cli_reports_what_it_built(bert_slice):
    env = {**os.environ, "MEGATRON_PATCHES_DATA": str(default_cache_dir())}
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "prepare_data.py"), "--family", "bert",
         "--max-documents", str(BERT_SLICE)],
        capture_output=True, text=True, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"{BERT_SLICE} documents, {bert_slice.num_tokens:,} tokens" in done.stdout
    assert f"--data-path {bert_slice.data_prefix} --tokenizer-type BertWordPieceLowerCase" in done.stdout
    bad = subprocess.run(
        [sys.executable, str(REPO / "tools" / "prepare_data.py"), "--max-documents", "100000"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert bad.returncode == 1 and "exceeds the 269 chapters" in bad.stderr


def test_gpt_end_of_document_flags_shape_the_samples():
    """--reset-position-ids, --reset-attention-mask, --eod-mask-loss and
    --no-create-attention-mask-in-dataloader reach Megatron-Core's GPT dataset (mock documents end
    in the NullTokenizer's EOD, id 1000 here)."""
    from megatron_patches.data import datasets
    from megatron_patches.training.arguments import parse_args
    from megatron_patches.training.validation import validate_args

    def first_sample_with_eod(*flags):
        args = validate_args(parse_args(["--mock-data", "--vocab-size", "1000", "--train-iters", "2", *flags]), 1)
        tokenizer = datasets.build_tokenizer(args)
        train, _, _ = datasets.build_datasets(args, tokenizer)
        sample = next(train[i] for i in range(32) if (train[i]["tokens"] == tokenizer.eod).any())
        return sample, int((sample["tokens"] == tokenizer.eod).nonzero()[0])

    plain, eod = first_sample_with_eod()
    assert plain["position_ids"][eod + 1] == eod + 1 and plain["loss_mask"][eod] == 1.0
    assert not plain["attention_mask"][0, eod + 1, eod - 1]  # the next document sees the previous one
    reset, eod = first_sample_with_eod("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
    assert reset["position_ids"][eod + 1] == 0 and reset["loss_mask"][eod] == 0.0
    assert reset["attention_mask"][0, eod + 1, eod - 1] and not reset["attention_mask"][0, eod + 1, eod + 1]
    no_mask, _ = first_sample_with_eod("--no-create-attention-mask-in-dataloader")
    assert "attention_mask" not in no_mask and datasets.gpt_batch({**no_mask})["attention_mask"] is None
