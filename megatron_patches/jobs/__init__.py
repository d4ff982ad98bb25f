"""Jobs: run configs planned into Slurm jobs (`plan.py`), for the launcher and the tools."""
