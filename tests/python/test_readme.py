"""The README's quick start runs as written (on the GPU where there is one, else the CPU)."""

import os
import re
import subprocess
import sys

_README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _quick_start() -> str:
    text = open(_README).read()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the quick start holds one python block"
    return blocks[0]


def test_quick_start_runs_as_written():
    r = subprocess.run([sys.executable, "-c", _quick_start()], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr
    assert "positions (3, 2, 64)" in r.stdout and "fp8 grad (512, 256)" in r.stdout, r.stdout


def test_first_lines_give_the_two_commands():
    head = open(_README).read().split("\n")[:12]
    assert any(line.startswith("tools/bench") for line in head) and any(line.startswith("tools/test") for line in head)
