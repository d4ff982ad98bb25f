"""Run a function on N local gloo ranks, for multi-rank tests.

Two ways, both returning the JSON-serialisable value each rank's function returned, in rank
order, and both failing loudly (exit status and the tail of every rank's output) when a rank
fails or the ranks run past the timeout:

- `run_ranks(world_size, module, fn_name, timeout)`: one fresh Python process per rank
  (`python tests/support/mp.py ...`). Each pays the torch/Megatron imports (3-7 s), so group many
  checks into one function.
- `run_forked(world_size, fn, timeout)`: forks the *current* process once per rank. The children
  inherit its imports (a fork costs milliseconds) and its module state, so a process that has
  imported Megatron but changed nothing can fork many isolated experiments from that state.
  Linux only; the parent must not have initialised a process group or a thread pool.
- `single_rank_group()`: a context manager making *this* process a gloo world of one rank,
  for in-process tests of code that needs a default process group.

Every rank initialises the default gloo process group from a file store in a private
temporary directory (no TCP port to pick, so no port races between concurrent test runs).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

TAIL_CHARS = 6000
"""How much of each failed rank's output a failure message quotes."""


class RanksFailed(RuntimeError):
    """A rank exited with an error, or the ranks ran past their timeout."""


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-TAIL_CHARS:]


def _failure(what: str, logs: Sequence[Path], codes: Sequence[int | None]) -> RanksFailed:
    parts = [what]
    for rank, (log, code) in enumerate(zip(logs, codes)):
        parts.append(f"--- rank {rank} (exit status {code}) ---\n{_tail(log)}")
    return RanksFailed("\n".join(parts))


def _init_gloo(store_file: Path, rank: int, world_size: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        backend="gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=5),
    )


@contextlib.contextmanager
def single_rank_group():
    """This process's default gloo process group as a world of one rank, for in-process tests."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("single_rank_group(): a default process group already exists in this process")
    with tempfile.TemporaryDirectory(prefix="mp_single_") as tmp:
        _init_gloo(Path(tmp) / "store", 0, 1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _load_function(module: str, fn_name: str) -> Callable:
    """`module` is a dotted module name or a path to a .py file."""
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_mp_worker_{Path(module).stem}", module)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        spec.loader.exec_module(loaded)
    else:
        loaded = importlib.import_module(module)
    return getattr(loaded, fn_name)


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    # N ranks on a small machine: one intra-op thread each, unless the caller chose otherwise.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_ranks(
    world_size: int,
    module: str | os.PathLike,
    fn_name: str,
    timeout: float,
    args: Sequence = (),
    gloo: bool = True,
) -> list:
    """Runs `module.fn_name(*args)` on `world_size` new processes; returns each rank's result.

    module: a dotted module name or a .py file path; args: JSON-serialisable positional
    arguments. With gloo=False no process group is initialised (a clean process to run `fn`
    in, e.g. one that then calls `run_forked`).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    with tempfile.TemporaryDirectory(prefix="mp_ranks_") as tmp:
        tmp_path = Path(tmp)
        logs = [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
        procs = []
        for rank in range(world_size):
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                str(module),
                fn_name,
                json.dumps(list(args)),
                str(tmp_path),
                "1" if gloo else "0",
            ]
            with open(logs[rank], "w") as log:
                procs.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_rank_env(rank, world_size))
                )
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * world_size
        while any(code is None for code in codes):
            for rank, proc in enumerate(procs):
                if codes[rank] is None:
                    codes[rank] = proc.poll()
            failed = any(code not in (None, 0) for code in codes)
            if failed or time.monotonic() > deadline:
                # A failed rank leaves the others blocked in a collective: stop them all.
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                codes = [proc.wait() for proc in procs]
                what = f"{fn_name} on {world_size} ranks: " + (
                    "a rank failed" if failed else f"ran past the {timeout:.0f} s timeout"
                )
                raise _failure(what, logs, codes)
            time.sleep(0.05)
        return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def run_forked(world_size: int, fn: Callable, timeout: float, args: Sequence = ()) -> list:
    """Forks `world_size` children of this process; each joins a gloo group and runs fn(*args).

    Returns each rank's JSON-serialisable result. The children exit with os._exit, so nothing
    of the parent's (pytest, atexit hooks) runs in them.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    with tempfile.TemporaryDirectory(prefix="mp_forked_") as tmp:
        tmp_path = Path(tmp)
        logs = [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
        pids = []
        for rank in range(world_size):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _forked_child(rank, world_size, fn, args, tmp_path, logs[rank])
            pids.append(pid)
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * world_size
        while any(code is None for code in codes):
            for rank, pid in enumerate(pids):
                if codes[rank] is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
            failed = any(code not in (None, 0) for code in codes)
            if failed or time.monotonic() > deadline:
                for rank, pid in enumerate(pids):
                    if codes[rank] is None:
                        os.kill(pid, 9)
                        codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                what = f"{getattr(fn, '__name__', fn)} on {world_size} forked ranks: " + (
                    "a rank failed" if failed else f"ran past the {timeout:.0f} s timeout"
                )
                raise _failure(what, logs, codes)
            time.sleep(0.01)
        return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _forked_child(rank, world_size, fn, args, tmp_path: Path, log: Path) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        _init_gloo(tmp_path / "store", rank, world_size)
        result = fn(*args)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(result))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(module: str, fn_name: str, args_json: str, out_dir: str, gloo: str) -> None:
    # The test module imports `support.*` as pytest's `pythonpath = ["tests"]` lets it.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch

    if not torch.cuda.is_available():
        from megatron_patches.compat.cpu import import_megatron_with_eager_fusers

        import_megatron_with_eager_fusers()  # Megatron-Core as the training script imports it on CPU
    if gloo == "1":
        _init_gloo(Path(out_dir) / "store", rank, world_size)
    result = _load_function(module, fn_name)(*json.loads(args_json))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if gloo == "1":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:])
