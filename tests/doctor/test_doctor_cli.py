"""``funcgrad doctor``: exit status 0 / 1 / 2, the model-file errors (one message naming the
missing piece and showing the expected file, no traceback from inside funcgrad), the reports."""
import json
import pathlib
import textwrap

import pytest

from funcgrad.cli import main

HEALTHY = '''
import numpy as np, jax, funcgrad as fg
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = np.argmax(x @ rng.normal(size=(8, 3)), axis=1).astype(np.int32)
data = {"x": x, "y": y}
classes = 3

def init(key):
    return fg.mlp_init(key, (8, 16, 3), activation="tanh")

def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"], activation="tanh"),
                                    batch["y"])
'''


def _file(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _usage_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_healthy_file_exits_0_and_writes_both_reports(tmp_path, capsys):
    out = tmp_path / "out"
    status = main(["doctor", _file(tmp_path, HEALTHY), "--checks", "data,init_loss,grad_flow",
                   "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "data" in printed and "exit status 0" in printed
    report = json.loads((out / "doctor.json").read_text())
    assert [f["check"] for f in report["findings"]] == ["data", "init_loss", "grad_flow"]
    assert (out / "doctor.html").read_text().startswith("<!DOCTYPE html>")


def test_skip_leaves_checks_out_of_the_selection(tmp_path, capsys):
    out = tmp_path / "r.json"
    status = main(["doctor", _file(tmp_path, HEALTHY), "--checks", "data,init_loss",
                   "--skip", "data", "--json", str(out), "--quiet"])
    assert status == 0, capsys.readouterr().out
    assert [f["check"] for f in json.loads(out.read_text())["findings"]] == ["init_loss"]


def test_a_file_defining_step_kwargs_is_a_usage_error_naming_step(tmp_path, capsys):
    old = HEALTHY + 'step_kwargs = {"clip_norm": 1.0}\n'
    err = _usage_error(["doctor", _file(tmp_path, old), "--quiet"], capsys)
    assert "step_kwargs is no longer read" in err and "step = fg.make_train_step(" in err


def test_a_failing_check_exits_1(tmp_path, capsys):
    shifted = HEALTHY.replace('data = {"x": x, "y": y}', 'data = {"x": x, "y": y + 1}')
    assert main(["doctor", _file(tmp_path, shifted), "--checks", "data", "--quiet"]) == 1
    assert "shifted" in capsys.readouterr().out


def test_missing_names_are_named_with_the_expected_file(tmp_path, capsys):
    err = _usage_error(["doctor", _file(tmp_path, "x = 1\n"), "--quiet"], capsys)
    assert "does not define init and loss" in err and "A model file defines" in err
    no_data = HEALTHY.replace('data = {"x": x, "y": y}', "")
    err = _usage_error(["doctor", _file(tmp_path, no_data), "--quiet"], capsys)
    assert "does not define data" in err


def test_a_file_that_raises_on_import_is_a_usage_error(tmp_path, capsys):
    err = _usage_error(["doctor", _file(tmp_path, "import numpy\nraise KeyError('oops')\n"),
                        "--quiet"], capsys)
    assert "importing the model file raised KeyError: 'oops' (at model.py:2" in err


def test_data_of_the_wrong_shape_is_a_usage_error(tmp_path, capsys):
    wrong = HEALTHY.replace("size=(96, 8)", "size=(96, 7)").replace("@ rng.normal(size=(8, 3))",
                                                                   "@ rng.normal(size=(7, 3))")
    err = _usage_error(["doctor", _file(tmp_path, wrong), "--quiet"], capsys)
    assert "the loss does not run on a batch of the data" in err and "(at model.py:" in err


def test_a_loss_that_raises_is_a_usage_error(tmp_path, capsys):
    head = "    return fg.softmax_cross_entropy("
    broken = HEALTHY.replace(head, "    raise RuntimeError('not yet')\n" + head)
    err = _usage_error(["doctor", _file(tmp_path, broken), "--quiet"], capsys)
    assert "RuntimeError: not yet" in err


def test_flags_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's flag errors exit with status 2
        main(["doctor", "--checks", "data,fd"])
    assert exit_.value.code == 2
    assert "argument --checks: unknown check(s) fd" in capsys.readouterr().err
    err = _usage_error(["doctor", str(tmp_path / "missing.py")], capsys)
    assert "no model file" in err


def test_help_shows_the_model_file_layout(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "def init(key)" in text and "objective" in text and "--checks" in text


def test_the_default_model_is_the_digits_mlp(capsys):
    assert main(["doctor", "--checks", "init_loss", "--quiet"]) == 0
    assert "digits_mlp.py" in capsys.readouterr().out


def test_python_dash_m_and_the_package_layout():
    import funcgrad.cli.doctor
    import funcgrad.cli.train
    assert pathlib.Path(funcgrad.cli.doctor.__file__).name == "doctor.py"
    assert callable(funcgrad.cli.train.add_parser) and callable(funcgrad.cli.doctor.run)
