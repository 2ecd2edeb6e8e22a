"""Every example runs, prints its comparison and exits 0; a disagreement makes it exit 1."""
import contextlib
import io
import pathlib
import runpy
import subprocess
import sys

import pytest

EXAMPLES = sorted(pathlib.Path(__file__).parent.parent.joinpath("examples").glob("[0-9]*.py"))


def _run_as_script(path: pathlib.Path) -> tuple[int, str]:
    """(exit status, stdout) of ``python path``, run in this process: a subprocess per example
    cost a fresh interpreter and JAX import each (about 4 s of CPU), the same for all of them.
    As for a script, __name__ is "__main__" and the example's folder is first on sys.path (for
    `_check`); SystemExit gives the status, and any other exception propagates and fails the
    test. Warnings are errors here (pyproject), stricter than a script's printed warning."""
    out = io.StringIO()
    sys.path.insert(0, str(path.parent))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.path.remove(str(path.parent))
    return status, out.getvalue()


def test_there_are_examples():
    assert [p.name[:2] for p in EXAMPLES][:3] == ["01", "02", "03"]


def _marked(path: pathlib.Path):
    """An example that computes in float16 is marked `float16` (skipped where XLA cannot
    compile float16: tests/conftest.py)."""
    uses_float16 = "jnp.float16" in path.read_text()
    return pytest.param(path, marks=pytest.mark.float16) if uses_float16 else path


@pytest.mark.parametrize("path", [_marked(p) for p in EXAMPLES], ids=lambda p: p.stem)
def test_example_runs_and_agrees(path):
    status, stdout = _run_as_script(path)
    assert status == 0, stdout
    assert "all values agree" in stdout and "MISMATCH" not in stdout


def test_an_example_runs_as_a_script():
    # The command a reader types, in a fresh interpreter: the first example end to end.
    proc = subprocess.run([sys.executable, str(EXAMPLES[0])], capture_output=True, text=True,
                          timeout=120)
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
    # The same through the in-process runner the examples use: status 1, the row printed.
    assert _run_as_script(script) == (1, proc.stdout)
