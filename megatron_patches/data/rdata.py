"""A reader for R's serialization format (version 2/3, XDR) and lazy-load databases, enough for
the data in an R package's .rdb/.rdx files (the Austen novels of `r-cran-janeaustenr`), in the
Python standard library."""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable


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
