"""The up-front check of a Megatron indexed dataset (`<prefix>.idx` + `<prefix>.bin`).

Megatron-Core reads these files only when the datasets are built, after the process groups
started, and a wrong file then fails with a bare `assert` (bad header) or a numpy error deep in
a memory map, on every rank. `index_problem` reads the index header and its last entry only (a
few dozen bytes, whatever the dataset's size) and says what is wrong in words.

The format (megatron/core/datasets/indexed_dataset.py, version 1): the 9-byte magic
`MMIDIDX\\x00\\x00`, version (u64) 1, the token dtype code (u8), the sequence count S (u64), the
document count D (u64); then S int32 sequence lengths, S int64 byte offsets into the .bin, D int64
document indices (and S int8 modes in multimodal datasets). The .bin is the tokens, back to back.
"""

from __future__ import annotations

import struct
from pathlib import Path

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# dtype code -> (name, bytes per token)
TOKEN_DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
                6: ("float64", 8), 7: ("float32", 4), 8: ("uint16", 2)}


def index_problem(prefix: str) -> str | None:
    """What is wrong with the dataset at `prefix` (its files exist), or None."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    size = idx.stat().st_size
    if size < HEADER_BYTES:
        return f"{idx} is {size} bytes, shorter than an index header ({HEADER_BYTES} bytes): empty or truncated"
    with idx.open("rb") as stream:
        magic = stream.read(9)
        if magic != INDEX_MAGIC:
            return f"{idx} does not start with Megatron's index magic {INDEX_MAGIC!r} (found {magic!r}): not an index file"
        version, code, sequences, documents = struct.unpack("<QBQQ", stream.read(HEADER_BYTES - 9))
        if version != 1:
            return f"{idx} is index format version {version}; Megatron-Core 0.16 reads version 1"
        if code not in TOKEN_DTYPES:
            return f"{idx} names token dtype code {code}; valid codes: {sorted(TOKEN_DTYPES)}"
        if sequences == 0:
            return f"{idx} holds no sequences"
        needed = HEADER_BYTES + sequences * (4 + 8) + documents * 8
        if size < needed:
            return (f"{idx} is {size} bytes but its header promises {sequences} sequences and {documents} document "
                    f"indices ({needed} bytes): truncated")
        stream.seek(HEADER_BYTES + (sequences - 1) * 4)
        (last_length,) = struct.unpack("<i", stream.read(4))
        stream.seek(HEADER_BYTES + sequences * 4 + (sequences - 1) * 8)
        (last_pointer,) = struct.unpack("<q", stream.read(8))
    name, token_bytes = TOKEN_DTYPES[code]
    expected = last_pointer + last_length * token_bytes
    actual = bin_.stat().st_size
    if actual != expected:
        return (f"{bin_} is {actual} bytes but {idx} describes {expected} bytes ({sequences} sequences of {name} "
                "tokens): truncated, or the two files do not belong together")
    return None
