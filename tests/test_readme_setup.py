"""The README's setup is what CI runs: its install, demo and test commands appear in `.ci/run`, in
that order, inside a fresh virtual environment, so a missing install step cannot hide behind
packages already on the machine."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    """The commands of the README's first shell block under "## Setup", comments stripped."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Setup"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_ci_runs_the_readme_setup_in_a_fresh_environment():
    commands = setup_commands()
    install = next(c for c in commands if c.startswith("pip install"))
    demo = next(c for c in commands if c.startswith("moestream run"))
    tests = next(c for c in commands if "pytest" in c)
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "bin/activate" in ci, "CI must build a fresh virtual environment"
    # pip's own options may come before the README's arguments (quiet output, no byte-compiling)
    installed = re.search(r"pip install(?: --?[a-z][a-z-]*)* " + re.escape(install.removeprefix("pip install ")), ci)
    positions = [installed.start() if installed else -1, ci.find(demo), ci.find(tests)]
    assert -1 not in positions, f"CI must run the README's commands: {install!r}, {demo!r}, {tests!r}"
    assert positions == sorted(positions) and ci.find("venv") < positions[0]


def test_the_setup_block_needs_no_gpu_extra():
    """The GPU extra has its own block: the CPU block must not install it."""
    assert not any(".[gpu]" in c for c in setup_commands())
