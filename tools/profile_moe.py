"""Profile one device type for zebra's Asym-EA: time one expert FFN and one layer's non-expert
block with the real per-micro-batch token counts, measure memory, merge into a profile file.

    # one run per device type, all into one file (the shape and workload must match):
    python tools/profile_moe.py --model-config mixtral_d2 --attention-ranks 6 --expert-ranks 6 \\
        --microbatches 4 --seq-length 4096 --micro-batch-size 1 --device cuda --device-type A40-48GB \\
        --role attention --dtype fp16 --out zebra_o1_d2.json
    python tools/profile_moe.py ... --device-type V100-SXM2-16GB --role expert --out zebra_o1_d2.json
    # then train with --zebra-asym-ea auto --zebra-profile zebra_o1_d2.json

What is timed and how memory is counted: megatron_patches/zebra/profiler.py (module docstring).
--device-type must be the GPU type name of the cluster config (configs/clusters/*.yaml) so that
the pool's attention and expert types find their entries. CPU runs (--device cpu) are for tests
and development; hide the GPUs (CUDA_VISIBLE_DEVICES=) to profile the CPU of a GPU machine.

Every flag is checked before anything is built; errors name the flag, its value and what is valid
(exit status 2).
"""

from __future__ import annotations

import argparse
import math
import os
import sys


from megatron_patches.config import ConfigError, load_model_config
from megatron_patches.zebra.profiler import (
    DTYPES,
    ROLES,
    ProfileError,
    ProfileRequest,
    check_profile_file,
    profile_device,
    write_profile,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profile_moe.py",
        description="Profile one device type for zebra's Asym-EA and merge it into a profile file.",
        allow_abbrev=False,
    )
    parser.add_argument("--model-config", required=True, metavar="NAME|FILE.yaml",
                        help="model config: a name under configs/models (mixtral_d2) or a YAML path")
    parser.add_argument("--microbatches", type=int, required=True, metavar="R",
                        help="zebra micro-batches per iteration (their activations are alive together)")
    parser.add_argument("--attention-ranks", type=int, required=True, metavar="M", help="attention ranks per ZP group")
    parser.add_argument("--expert-ranks", type=int, required=True, metavar="N",
                        help="expert ranks per ZP group; must divide the model's expert count")
    parser.add_argument("--seq-length", type=int, required=True, metavar="S", help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, required=True, metavar="B",
                        help="sequences per attention rank and micro-batch")
    parser.add_argument("--device", required=True, help="cpu or cuda (the current CUDA device)")
    parser.add_argument("--device-type", required=True, metavar="NAME",
                        help="name to store the measurements under: the cluster config's GPU type")
    parser.add_argument("--role", required=True, help=f"which role's figures to measure: {', '.join(ROLES)}")
    parser.add_argument("--out", required=True, metavar="FILE.json",
                        help="profile file; created, or merged into (one entry per device type)")
    parser.add_argument("--dtype", default="fp32",
                        help=f"parameter/activation dtype: {', '.join(DTYPES)} (default fp32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per part; the median is kept (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before them (default 2)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="memory budget of one device in GB (1e9 bytes); default: the device's own "
                        "(free GPU memory after CUDA start-up, or the machine's RAM on CPU)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of weights and inputs (default 1234)")
    return parser


def request_from_args(args: argparse.Namespace) -> ProfileRequest:
    """The checked ProfileRequest; ProfileError (or ConfigError for the model config) otherwise."""
    model = load_model_config(args.model_config)
    memory = None
    if args.memory_gb is not None:
        if not math.isfinite(args.memory_gb) or args.memory_gb <= 0:
            raise ProfileError(f"--memory-gb={args.memory_gb!r} is invalid; expected a positive number of GB")
        memory = int(args.memory_gb * 1e9)
    return ProfileRequest(
        model=model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        microbatches=args.microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        device=args.device,
        device_type=args.device_type,
        role=args.role,
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
        memory_bytes=memory,
        seed=args.seed,
    )


def _progress(line: str) -> None:
    print(f"[profile_moe] {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        request = request_from_args(args)
        check_profile_file(args.out, request)
    except (ProfileError, ConfigError) as err:
        parser.error(str(err))
    measurement = profile_device(request, progress=_progress)
    write_profile(args.out, measurement)
    profile = measurement.profile
    attention = "not measured (--role expert)"
    if profile.t_attention_s is not None:
        attention = f"{profile.t_attention_s * 1e3:.3f} ms"
    _progress(f"{profile.device_type}: T_attention {attention}, T_experts {profile.t_experts_s * 1e3:.3f} ms "
              f"({request.experts_per_expert_rank} experts), expert slots as attention GPU "
              f"{profile.expert_slots_as_attention}, as expert GPU {profile.expert_slots_as_expert}")
    _progress(f"merged into {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
