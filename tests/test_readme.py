"""The commands of the README and of docs/ work as written, in the environment the README sets up.

Every ```bash block of README.md and of every docs/*.md page (the modes, the Slurm launcher, the
tools and the simulator live there) is read: each script a command names must exist, each
`python SCRIPT.py` must answer `--help`, and the cheap examples (trace, plan, plots, the
simulator, dry-run submits) run exactly as written, only with fewer trace iterations, in a
scratch folder that sees the repository's configs/, tools/ and launch/. The `python` they run is
the project's environment first on PATH, which is what `source .venv/bin/activate` gives.
The training commands themselves are covered by the e2e tests (the main job by
test_training_distributed.py, which runs launch/local.sh).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
"""The pages whose commands are checked: the README first, then docs/ in name order."""

# The examples that run in seconds; the rest (training, benchmarks, sbatch) only answer --help.
RUNNABLE = ("python tools/make_trace.py", "python tools/plan.py", "python tools/plot_loads.py", "python tools/simulate.py")
# size knobs shrunk for the test, everything else as written
SHRINK = ((r"--iterations \d+", "--iterations 12"),)


def readme_commands(pages: list[Path] = DOCS) -> list[str]:
    """Every command of the pages' bash blocks (the README's and docs/'s), in page order:
    continuation lines joined, comments dropped."""
    commands = []
    blocks = [block for page in pages for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)]
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def script_of(command: str) -> str | None:
    """The script a command runs: the first .py or .sh word that is not a flag."""
    return next((word for word in shlex.split(command) if re.fullmatch(r"[\w./-]+\.(py|sh)", word)), None)


def environment() -> dict[str, str]:
    """What `source .venv/bin/activate` gives: the project's python first on PATH."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                VIRTUAL_ENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1")


def test_the_readme_activates_the_environment_before_any_python_command():
    text = README.read_text()
    first_python = min(text.index(f"\n{program} ") for program in ("python", "torchrun") if f"\n{program} " in text)
    assert text.index("source .venv/bin/activate") < first_python
    assert len(readme_commands()) > 30


def test_every_script_exists_and_every_python_script_answers_help():
    scripts = {script_of(command) for command in readme_commands()} - {None}
    missing = sorted(script for script in scripts if not (REPO / script).is_file())
    assert not missing, f"the README or docs/ name scripts that do not exist: {missing}"
    python_scripts = sorted({shlex.split(c)[1] for c in readme_commands() if c.startswith("python ") and script_of(c)})
    assert {"pretrain_gpt_moe.py", "launch/submit.py", "tools/simulate.py"} <= set(python_scripts)

    def answer(script: str) -> tuple[str, subprocess.CompletedProcess]:
        return script, subprocess.run(["python", script, "--help"], cwd=REPO, env=environment(), capture_output=True,
                                      text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for script, done in pool.map(answer, python_scripts):
            assert done.returncode == 0 and "usage:" in done.stdout, f"{script} --help:\n{done.stdout}{done.stderr}"


def test_the_cheap_examples_run_as_written(tmp_path):
    for name in ("configs", "tools", "launch"):
        (tmp_path / name).symlink_to(REPO / name)
    runnable = [c for c in readme_commands() if c.startswith(RUNNABLE) or (c.startswith("python launch/submit.py") and "--dry-run" in c)]
    assert sum(c.startswith("python launch/submit.py") for c in runnable) >= 3
    assert [c.split()[1] for c in runnable if not c.startswith("python launch")] == [
        "tools/make_trace.py", "tools/plan.py", "tools/plot_loads.py", "tools/make_trace.py", "tools/simulate.py",
        "tools/simulate.py", "tools/make_trace.py", "tools/simulate.py"]
    for command in runnable:
        for pattern, replacement in SHRINK:
            command = re.sub(pattern, replacement, command)
        done = subprocess.run(["bash", "-c", f"set -eo pipefail; {command}"], cwd=tmp_path, env=environment(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    produced = {path.name for path in tmp_path.iterdir()} | {path.name for path in (tmp_path / "plots").iterdir()}
    assert {"t.npz", "T.npz", "M.npz", "plan.json", "out.json", "out.png"} <= produced
    assert any(name.endswith(".png") for name in os.listdir(tmp_path / "plots"))


@pytest.mark.parametrize("command", ["bash launch/local.sh", "bash tools/setup_env.sh && .venv/bin/python -m pytest -q tests"])
def test_the_two_main_commands_are_in_the_readme(command):
    assert command in readme_commands([README])
