"""Pretrain a GPT or BERT Mixture-of-Experts model with Megatron-Core (thin entry point).

    python pretrain_gpt_moe.py                                   # embedded default, CPU
    torchrun --nproc-per-node 4 pretrain_gpt_moe.py              # 4 local ranks, EP=4
    torchrun ... pretrain_gpt_moe.py --config configs/models/gpt_moe_s.yaml --micro-batch-size 1 \
        --train-iters 500 --lr 2e-4 --data-path ...                       # Megatron-LM requires these

Flags use Megatron-LM's names (docs/flags.md). All validation happens here, before any
process group starts.
"""

import gc
import os
import sys
import time

from megatron_patches.compat.known_warnings import show_once
from megatron_patches.compat.lifetime import die_with_parent

# before anything imports Megatron-Core: its import-time warnings, once per job, one line each
show_once(int(os.environ.get("RANK", "0")))

from megatron_patches.training.arguments import ArgumentError, parse_args  # noqa: E402
from megatron_patches.training.validation import validate_args  # noqa: E402


REFUSAL_GRACE_S = 10.0
"""How long a rank other than 0 waits before printing a refusal (longer than ranks' import skew)."""


def say_error(error: Exception) -> int:
    """The one-line refusal on stderr, naming the rank when it is not rank 0; exit code 2."""
    rank = int(os.environ.get("RANK", "0"))
    print(f"pretrain_gpt_moe.py: error{f' (rank {rank})' if rank else ''}: {error}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # under torchrun: end with the agent, even when it is killed with SIGKILL
        die_with_parent(os.getppid())
    try:
        args = parse_args(argv)
        validate_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ArgumentError as error:
        # Every rank validates the same flags and refuses alike. Rank 0 says why at once. The
        # launcher (torchrun, srun --kill-on-bad-exit) kills the other ranks as soon as one exits,
        # and rank 0 may still be importing when a faster rank refuses: so the others wait first,
        # then say it too, and are usually killed before they print.
        if int(os.environ.get("RANK", "0")) != 0:
            time.sleep(REFUSAL_GRACE_S)
        return say_error(error)
    if args.cpu:
        # Hide the GPUs before anything initialises CUDA: the CPU shims refuse to run with CUDA visible.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not args.use_cuda:
        from megatron_patches.compat.cpu import import_megatron_with_eager_fusers

        import_megatron_with_eager_fusers()  # before the imports below bring Megatron-Core in
    from megatron_patches.training.checkpoint import CheckpointUnreadable, CheckpointWriteFailed
    from megatron_patches.training.loop import NonFiniteTraining, pretrain

    try:
        pretrain(args)
    except CheckpointUnreadable as error:
        # found at the load, after the manifest check (which covers every file it lists)
        return say_error(error)
    except NonFiniteTraining:
        return 3  # rank 0 has said why (training.loop.stop_or_skip)
    except CheckpointWriteFailed:
        return 5  # the failing rank has said why (training.loop.save)
    return 0


# The guard matters: a process spawned by multiprocessing re-imports this file. Its top level
# stays light (no torch: tests/test_architecture.py checks it).
if __name__ == "__main__":
    code = main()
    # Everything is written, closed and torn down by now. The interpreter's last cyclic garbage
    # collection over Megatron's and torch's object graphs is all that is left, and it is slow:
    # ~1 s per rank, 8.8 s for 8 ranks sharing 2 cores from the summary line to the launcher's
    # exit (1.7 s with the objects frozen). atexit handlers and module teardown still run.
    gc.freeze()
    sys.exit(code)
