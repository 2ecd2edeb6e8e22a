"""Every example runs, prints its comparison and exits 0; a disagreement makes it exit 1."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted(pathlib.Path(__file__).parent.parent.joinpath("examples").glob("[0-9]*.py"))


def test_there_are_examples():
    assert [p.name[:2] for p in EXAMPLES][:3] == ["01", "02", "03"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_agrees(path):
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all values agree" in proc.stdout and "MISMATCH" not in proc.stdout


def test_a_disagreement_exits_nonzero(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLES[0].parent)!r})\n"
        "from _check import Check\n"
        "c = Check('deliberately wrong')\n"
        "c.row('2 + 2', 2 + 2, 5)\n"
        "c.done()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout
