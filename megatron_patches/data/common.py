"""What corpus preparation and tokenizer staging share: the error type, the progress log and
atomic installation of a fully built file or directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class CorpusError(RuntimeError):
    """The corpus could not be prepared; the message names the failing step and a fix."""


def log(message: str) -> None:
    print(f"[corpus] {message}", flush=True)


def install_atomically(staged: Path, target: Path) -> None:
    """Move a fully built file or directory into place; a racing winner's copy is kept."""
    try:
        os.rename(staged, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(staged, ignore_errors=True)
