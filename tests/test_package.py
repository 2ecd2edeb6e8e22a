"""`import funcgrad` is lazy: each public name and old module path imports what it names when
first used, and resolves to the same object as before."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import funcgrad as fg


def test_import_funcgrad_imports_no_library():
    # Before: `import funcgrad` imported jax, scipy.special, optax... (2.3 s here), and so did
    # `funcgrad train` for modules it never uses.
    code = ("import sys, funcgrad; print(sorted(m for m in ('jax', 'numpy', 'scipy', 'optax', "
            "'sklearn', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_public_name_is_its_modules_object():
    # The names and their modules, read from the source independently of `_lazy_names`.
    tree = ast.parse(Path(fg.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If)]
    expected = {a.asname: n.module for n in block.body for a in n.names}
    assert set(fg.__all__) == set(expected) and len(expected) >= 75  # 75 on 2026-12-02
    for name, module in expected.items():
        if module == "funcgrad":
            assert getattr(fg, name) is importlib.import_module(f"funcgrad.{name}")
        else:
            assert getattr(fg, name) is getattr(importlib.import_module(module), name), name
    assert "check_grads" in dir(fg)


def test_old_module_paths_still_import():
    old_fit = importlib.import_module("funcgrad.fit")   # the module funcgrad.train.fit...
    assert old_fit is sys.modules["funcgrad.train.fit"]
    assert fg.fit is old_fit.fit                        # ...while fg.fit stays the function
    import funcgrad.masks
    assert funcgrad.masks is sys.modules["funcgrad.train.masks"]
    assert funcgrad.masks.__spec__.name == "funcgrad.train.masks"
    assert fg.monitor.grad_monitor is fg.grad_monitor and fg.testing is sys.modules[
        "funcgrad.check.testing"]
