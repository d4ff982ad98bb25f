# Per-task prologue of every srun step (submit.py inlines this file into the job script and
# runs it as `bash -c "$task_env" task PROGRAM ARGS...`): it turns Slurm's task ids into the
# variables torch.distributed reads, then execs the program.
#
#   RANK          global rank; WORLD_SIZE = SLURM_NTASKS; LOCAL_RANK = SLURM_LOCALID (GPU index)
#   HET_COMPONENT the hetjob component (node group) this task runs in; 0 in a homogeneous job
#
# Homogeneous job: RANK = SLURM_PROCID.
# Heterogeneous job (`srun --het-group=0,1,...`), as measured on Slurm 22.05: SLURM_PROCID
# counts the tasks of component 0 first, then component 1, ...; SLURM_NTASKS is the total;
# SLURM_HET_JOB_COMPONENT is NOT set inside the step, so the component is derived from the
# task counts SLURM_NTASKS_HET_GROUP_<c>. With ZP_GROUPS=G > 1 (zebra: G groups, each of M
# attention + N expert ranks) the ranks are interleaved so that every ZP group is a contiguous
# block with its attention ranks first: [A x M, E x N] x G. With G = 1 the order is
# SLURM_PROCID's (component 0 = attention pool first).
set -eo pipefail

component=0
index=$SLURM_PROCID
rank=$SLURM_PROCID
if [ -n "${SLURM_HET_SIZE:-}" ]; then
  groups=${ZP_GROUPS:-1}
  component=
  offset=0        # tasks of the components before component c
  before=0        # ranks of one ZP group in the components before component c
  for ((c = 0; c < SLURM_HET_SIZE; c++)); do
    count_var=SLURM_NTASKS_HET_GROUP_$c
    count=${!count_var:?is not set: cannot place task $SLURM_PROCID in a hetjob component}
    if ((count % groups != 0)); then
      echo "task_env: component $c has $count tasks, not divisible by ZP_GROUPS=$groups" >&2
      exit 1
    fi
    if [ -z "$component" ] && ((SLURM_PROCID < offset + count)); then
      component=$c
      index=$((SLURM_PROCID - offset))   # this task's place inside its component
      per_group=$((count / groups))      # its component's ranks in one ZP group
      ahead=$before                      # ranks of one ZP group ahead of its component
    fi
    offset=$((offset + count))
    before=$((before + count / groups))
  done
  if [ -z "$component" ]; then
    echo "task_env: task $SLURM_PROCID is beyond the $offset tasks of the $SLURM_HET_SIZE components" >&2
    exit 1
  fi
  group_size=$((SLURM_NTASKS / groups))  # ranks of one ZP group over all components
  rank=$(((index / per_group) * group_size + ahead + index % per_group))
fi

export RANK=$rank WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID HET_COMPONENT=$component
exec "$@"
