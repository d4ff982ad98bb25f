"""Run the training entry point's `main(argv)` on many command lines in one process, for the
failure catalogue's bad inputs (one process pays the imports once; every case is refused during
validation, before any process group, so nothing of one case outlives it).

    python tests/support/refusals.py < cases.json > results.json

cases.json: [{"argv": [...], "world_size": N}, ...]; results.json: [{"code": exit code,
"stdout": ..., "stderr": ...}, ...] in the same order. A case that validates would start
training: it is reported with code "validated" instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", REPO / "pretrain_gpt_moe.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    from megatron_patches.training import loop

    def validated(args):
        raise RuntimeError("validated")

    loop.pretrain = validated  # a case that passes validation must not train here
    results = []
    for case in json.load(sys.stdin):
        os.environ["WORLD_SIZE"] = str(case["world_size"])
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = entry.main(case["argv"])
            except RuntimeError as error:
                code = str(error)
            except SystemExit as error:
                code = error.code
        results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
