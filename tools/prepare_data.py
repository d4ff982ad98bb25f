#!/usr/bin/env python3
"""Prepare the offline training corpus (Jane Austen's novels) as a Megatron indexed dataset.

    python tools/prepare_data.py --family gpt                      # GPT-2 BPE, one doc per chapter
    python tools/prepare_data.py --family bert --max-documents 20  # WordPiece, sentence-level

Sources come from Debian (`r-cran-janeaustenr`) and PyPI (`openai-whisper` sdist for GPT-2's
BPE ranks); see megatron_patches/data/corpus.py. Prepared data is cached: a second run
returns at once. Prints what it built and the Megatron flags that use it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_patches.data.common import CorpusError
from megatron_patches.data.corpus import default_cache_dir, ensure_default_corpus
from megatron_patches.data.tokenizers import TOKENIZER_TYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--family", choices=sorted(TOKENIZER_TYPES), default="gpt",
                        help="gpt: GPT-2 BPE, one sequence per chapter; bert: WordPiece, one "
                             "sequence per sentence (default: gpt)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"cache directory (default: $MEGATRON_PATCHES_DATA or {default_cache_dir()})")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="keep only the first N chapters (a separate cached slice)")
    args = parser.parse_args(argv)
    if args.max_documents is not None and args.max_documents < 1:
        parser.error(f"--max-documents {args.max_documents}: must be a positive integer")

    started = time.perf_counter()
    try:
        paths = ensure_default_corpus(args.family, args.out, args.max_documents)
    except (CorpusError, ValueError) as error:
        print(f"prepare_data: {error}", file=sys.stderr)
        return 1
    files = [Path(f"{paths.data_prefix}.bin"), Path(f"{paths.data_prefix}.idx"), paths.vocab_file]
    if paths.merge_file is not None:
        files.append(paths.merge_file)
    print(f"{args.family} corpus ready in {time.perf_counter() - started:.1f}s: "
          f"{paths.num_documents} documents, {paths.num_tokens:,} tokens")
    for path in files:
        print(f"  {path}  ({path.stat().st_size:,} bytes)")
    flags = (f"--data-path {paths.data_prefix} --tokenizer-type {paths.tokenizer_type} "
             f"--vocab-file {paths.vocab_file}")
    if paths.merge_file is not None:
        flags += f" --merge-file {paths.merge_file}"
    print(f"Megatron flags: {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
