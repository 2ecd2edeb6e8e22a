"""The doctor on the planted-fault suite: every faulty model file is flagged by one of the checks
its EXPECT names (detection) at the place it names (localisation), and no healthy model gets a
warn or a fail (false alarms). benchmarks/doctor.py prints the same as a scoreboard.

The doctor runs its whole checklist on each of ~70 files (10-25 s each on a 2-core CPU), so this
module is marked slow: ``pytest -m slow tests/doctor/test_planted.py`` (or ``-k NAME`` for one).
"""
import warnings

import jax
import pytest

from funcgrad.doctor import doctor_file

from ._modelfile import model_files, module_of

FLAGS = ("warn", "fail")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    """Overrides tests/conftest.py's fixture of that name: the model files are user code written
    with JAX's default settings (``x @ w + b`` promotes the bias's rank)."""
    with jax.numpy_rank_promotion("allow"):
        yield


def _params():
    out = []
    for path in model_files():
        marks = [pytest.mark.slow]
        if "float16" in path.read_text():
            marks.append(pytest.mark.float16)
        out.append(pytest.param(path, id=path.stem, marks=marks))
    return out


def _said(findings) -> str:
    return "\n".join(f"  {f.check} {f.verdict}: {f.summary} | place {f.place}" for f in findings)


@pytest.mark.parametrize("path", _params())
def test_doctor_on_planted_model(path):
    expect = module_of(path).EXPECT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the models' own warnings (flax, coupling) are theirs
        report = doctor_file(path)
    flagged = [f for f in report.findings if f.verdict in FLAGS]
    errors = [f for f in report.findings if f.verdict == "error"]
    assert not errors, f"a check crashed:\n{_said(errors)}"
    if expect is None:
        assert not flagged, f"false alarm on a healthy model:\n{_said(flagged)}"
        return
    right = [f for f in flagged if f.check in expect["checks"]]
    assert right, (f"{expect['fault']} not detected by {sorted(expect['checks'])}; the doctor "
                   f"said:\n{_said(report.findings)}")
    place = expect["place"]
    if place is not None:
        texts = [" ".join([*map(str, (f.place or {}).values()), f.summary or ""]) for f in right]
        assert any(place in t for t in texts), f"{place!r} not named by:\n{_said(right)}"
