"""The checker's shape (issue 33, point 4): `check_grads` (every element) and `check_directional`
(random tangents), each with one meaning per keyword, the rarely changed settings in one
`CheckOptions`; the reports equal those of the old ``check_grads(mode=...)`` calls, and every
former keyword raises a TypeError that names where it went."""
import dataclasses
import inspect
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _report_cases import CASES

import funcgrad as fg
from funcgrad.check.grads import _MOVED_KEYWORDS

#: check_grads' keywords at 3a64a75, copied from its signature then.
OLD_KEYWORDS = ("argnums", "has_aux", "mode", "modes", "order", "eps", "rtol", "atol",
                "num_directions", "seed", "chunk_size", "allow_stop_gradient",
                "respect_stop_gradient", "progress", "lift_precision", "block_size")

#: Advice in the old reports' notes that is now spelled for both checks (the only note changed).
REWORDED = {r"declare it: check_grads\(\.\.\., (allow_stop_gradient=.*)\)\.$": r"declare it: \1."}


def _new_call(fn, args, old: dict, kind: str):
    """The old keywords `old` spelled the new way, as the CHANGELOG's migration table says."""
    old = dict(old)
    if kind == "audit":
        budget = {k: old.pop(k) for k in ("max_full_elements", "max_evaluations") if k in old}
        return fg.audit(fn, *args, options=fg.CheckOptions(**old), **budget)
    directional = old.pop("mode", "full") == "directional"
    keywords = {k: old.pop(k) for k in ("argnums", "has_aux", "allow_stop_gradient") if k in old}
    if directional:
        for k in ("num_directions", "block_size"):
            if k in old:
                keywords[k] = old.pop(k)
        return fg.check_directional(fn, *args, options=fg.CheckOptions(**old), **keywords)
    return fg.check_grads(fn, *args, options=fg.CheckOptions(**old), **keywords)


def _same(new, old, where=""):
    """Equal, floats to 1e-6 relative or 1e-8 absolute (the recorded run's last bits may differ
    on another JAX or CPU; the errors of passing rows are round-off, ~1e-10)."""
    if isinstance(old, float) and isinstance(new, float):
        assert new == pytest.approx(old, rel=1e-6, abs=1e-8, nan_ok=True), where
    elif isinstance(old, dict):
        assert set(new) == set(old), where
        for key in old:
            _same(new[key], old[key], f"{where}.{key}")
    elif isinstance(old, list):
        assert len(new) == len(old), (where, new, old)
        for i, (a, b) in enumerate(zip(new, old)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert new == old, (where, new, old)


#: A passing row's error fields are round-off (~1e-10): which element is worst, and its values,
#: change with XLA's optimisation level (tests/conftest.py sets 0) and the CPU.
ROUND_OFF = ("worst_index", "analytic", "numeric", "max_abs_error", "max_rel_error")


@pytest.mark.parametrize("name", list(CASES))
def test_reports_equal_the_old_calls(name):
    # The second method is the old checker itself: its reports, recorded with the same
    # functions, arguments and settings before the split (tests/check/old_reports.json).
    fn, make, old, kind = CASES[name]
    recorded = json.loads((pathlib.Path(__file__).parent / "old_reports.json").read_text())[name]
    report = _new_call(fn, make(), old, kind).to_dict()
    for before, after in REWORDED.items():
        recorded["notes"] = [re.sub(before, after, n) for n in recorded["notes"]]
    for new_row, old_row in zip(report["rows"], recorded["rows"]):
        if old_row["status"] == "ok" and new_row["status"] == "ok":
            tolerance = report["atol"] + report["rtol"] * abs(old_row["numeric"] or 0.0)
            assert new_row["max_abs_error"] <= tolerance and old_row["max_abs_error"] <= tolerance
            for key in ROUND_OFF:
                new_row[key] = old_row[key]
    _same(report, recorded, name)
    assert report["mode"] == ("directional" if old.get("mode") == "directional"
                              or name == "audit_blocks" else "full")


@pytest.mark.parametrize("name", sorted(set(OLD_KEYWORDS) - {"argnums", "has_aux",
                                                              "allow_stop_gradient"}))
def test_each_former_keyword_names_its_new_home(name):
    f = lambda x: jnp.sum(x ** 2)
    assert name in _MOVED_KEYWORDS
    with pytest.raises(TypeError, match=rf"^check_grads: {name}= is no longer a keyword; "):
        fg.check_grads(f, jnp.ones(2), **{name: None})
    home = _MOVED_KEYWORDS[name]
    if name in {field.name for field in dataclasses.fields(fg.CheckOptions)}:
        assert f"options=funcgrad.CheckOptions({name}=" in home
    elif name in ("num_directions", "block_size"):
        assert f"funcgrad.check_directional(fn, *args, {name}=" in home
        assert name in inspect.signature(fg.check_directional).parameters
    elif name == "mode":
        assert "funcgrad.check_directional(" in home and "check_grads itself" in home
    else:
        assert name == "respect_stop_gradient" and "allow_stop_gradient=True" in home
    with pytest.raises(TypeError, match=r"check_grads\(\) got an unexpected keyword argument "
                                        r"'tolerance'"):
        fg.check_grads(f, jnp.ones(2), tolerance=1e-3)


def test_the_checks_keep_to_eight_parameters_each_with_one_meaning():
    # Counting every parameter inspect.signature shows, fn and *args included (issue 33).
    for check in (fg.check_grads, fg.check_directional, fg.audit):
        assert len(inspect.signature(check).parameters) <= 8, check.__name__
    full = set(inspect.signature(fg.check_grads).parameters)
    directional = set(inspect.signature(fg.check_directional).parameters)
    assert directional - full == {"num_directions", "block_size"}
    assert full - directional == {"moved"}


def test_check_directional_finds_a_planted_wrong_custom_vjp():
    # f(x) = sum(sin(x)) with a custom_vjp whose backward multiplies element 13 by 1.5. By hand:
    # JAX's value there is 1.5·cos(x13), the truth cos(x13); the check must fail the leaf and
    # bisect to element 13 with analytic and numeric equal to those (to the central
    # difference's error, ~1e-10 at eps = 1e-6 in float64).
    x = jnp.linspace(-1.0, 2.0, 32)
    scale = jnp.ones(32).at[13].set(1.5)

    @jax.custom_vjp
    def f(x):
        return jnp.sum(jnp.sin(x))
    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x) * scale,))

    report = fg.check_directional(f, x, num_directions=2, options=fg.CheckOptions(seed=3))
    [row] = report.rows
    assert report.mode == "directional" and row.status == "fail" and row.worst_index == (13,)
    truth = math.cos(float(np.linspace(-1.0, 2.0, 32, dtype=np.float32)[13]))
    assert row.analytic == pytest.approx(1.5 * truth, rel=1e-6)
    assert row.numeric == pytest.approx(truth, rel=1e-6)
    assert any("custom_vjp rule of f" in n for n in report.notes)
    # The same function without the plant passes, with a stated resolution.
    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x),))
    assert fg.check_directional(f, x).rows[0].resolution > 0


def test_check_directional_refuses_bad_tangent_counts_and_blocks():
    f = lambda x: jnp.sum(x ** 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="check_directional: num_directions must be a "
                                             "positive int"):
            fg.check_directional(f, jnp.ones(2), num_directions=bad)
    for bad in (0, 1.5, False):
        with pytest.raises(ValueError, match="check_directional: block_size must be a "
                                             "positive int"):
            fg.check_directional(f, jnp.ones(2), block_size=bad)
    with pytest.raises(TypeError, match="check_directional: options must be a "
                                        "funcgrad.CheckOptions"):
        fg.check_directional(f, jnp.ones(2), options={"rtol": 1e-3})
    with pytest.raises(ValueError, match="check_directional: argnums=3 is out of range"):
        fg.check_directional(f, jnp.ones(2), argnums=3)


def test_check_options_hold_one_value_each_and_say_what_is_wrong():
    options = fg.CheckOptions(rtol=1e-4, modes=["fwd", "rev", "fwd"], seed=2)
    assert options.modes == ("fwd", "rev") and hash(options) == hash(
        fg.CheckOptions(rtol=1e-4, modes=("fwd", "rev"), seed=2))
    with pytest.raises(AttributeError):
        options.rtol = 1.0  # frozen
    # The defaults are TOLERANCES' row for the dtype; a field given replaces its entry only.
    assert fg.CheckOptions().tolerances("float32") == (1e-3, 1e-2, 1e-3)
    assert options.tolerances("float64") == (1e-6, 1e-4, 1e-7)
    assert fg.CheckOptions(atol=0).tolerances("bfloat16") == (1e-1, 2e-1, 0.0)
    for kwargs, error, match in [
            ({"eps": 0.0}, ValueError, r"eps must be a finite number > 0 or None, got 0\.0"),
            ({"eps": "1e-3"}, TypeError, r"eps must be a number or None, got str"),
            ({"rtol": -1e-3}, ValueError, r"rtol must be a finite number >= 0 or None"),
            ({"atol": float("nan")}, ValueError, r"atol must be a finite number >= 0"),
            ({"modes": "rev"}, TypeError, r"modes must be a tuple of 'rev' and/or 'fwd'"),
            ({"modes": ()}, ValueError, r"modes must be a non-empty subset"),
            ({"modes": ("bwd",)}, ValueError, r"modes must be a non-empty subset"),
            ({"order": 3}, ValueError, r"order must be 1 or 2, got 3"),
            ({"seed": -1}, ValueError, r"seed must be a non-negative int"),
            ({"chunk_size": 0}, ValueError, r"chunk_size must be a positive int or None"),
            ({"lift_precision": "yes"}, TypeError, r"lift_precision must be True or False"),
            ({"progress": "yes"}, TypeError, r"progress must be True, False or None")]:
        with pytest.raises(error, match=rf"^CheckOptions: {match}"):
            fg.CheckOptions(**kwargs)


def test_audit_passes_its_keywords_to_the_check_it_runs():
    # Small: audit is check_grads (the same report); large: check_directional in blocks, with
    # the options' seed drawing its tangents (the report equals check_directional's at the
    # block size audit names in its note).
    def f(p, x):
        return jnp.sum(jnp.tanh(p["w"] * x) + jax.lax.stop_gradient(p["b"]) * x)

    p, x = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(6)}, jnp.linspace(0.5, 1.0, 6)
    options = fg.CheckOptions(seed=4, modes=("rev",))
    small = fg.audit(f, p, x, allow_stop_gradient="p['b']", options=options)
    assert small.to_dict() == fg.check_grads(f, p, x, allow_stop_gradient="p['b']",
                                             options=options).to_dict()
    assert [r.status for r in small.rows] == ["stop_gradient_declared", "ok"]
    large = fg.audit(f, p, x, allow_stop_gradient=True, options=options, max_full_elements=4,
                     max_evaluations=100)
    assert large.mode == "directional" and large.ok
    block = int(large.notes[0].split("blocks of at most ")[1].split(" ")[0])
    direct = fg.check_directional(f, p, x, block_size=block, allow_stop_gradient=True,
                                  options=options)
    assert large.to_dict()["rows"] == direct.to_dict()["rows"]
