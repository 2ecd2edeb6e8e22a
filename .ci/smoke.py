"""Smoke test of an installed funcgrad (run by .ci/wheel_check from outside the checkout, in a
fresh virtual environment holding the wheel, not the source tree).

Imports every public name of funcgrad and its subpackages, checks a small loss's gradient
(a right one passes, a wrong custom rule fails), trains one epoch with the `funcgrad`
command, and checks a flax model's gradient through funcgrad.interop. Exits 1 naming what
failed."""
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

failures = []


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(what)


import funcgrad  # noqa: E402

where = pathlib.Path(funcgrad.__file__).resolve()
check("funcgrad is the installed wheel, not a source tree", "site-packages" in where.parts,
      str(where))
check("py.typed marker installed", (where.parent / "py.typed").exists())

for name in funcgrad.__all__:
    try:
        getattr(funcgrad, name)
    except Exception as error:  # noqa: BLE001 - reported by name
        check(f"funcgrad.{name}", False, f"{type(error).__name__}: {error}")
for sub in ("check", "debug", "train", "memory", "interop", "micro"):
    try:
        module = importlib.import_module(f"funcgrad.{sub}")
    except Exception as error:  # noqa: BLE001 - names the missing module
        check(f"import funcgrad.{sub}", False, f"{type(error).__name__}: {error}")
        continue
    for name in getattr(module, "__all__", ()):
        try:
            getattr(module, name)
        except Exception as error:  # noqa: BLE001
            check(f"funcgrad.{sub}.{name}", False, f"{type(error).__name__}: {error}")
check(f"{len(funcgrad.__all__)} public names and 6 subpackages import", not failures)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import funcgrad as fg  # noqa: E402

report = fg.check_grads(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), jnp.ones((3, 2)) * 0.3,
                        jnp.arange(6.0).reshape(2, 3) / 6)
check("check_grads passes a right gradient", report.ok, str(report).splitlines()[0])


@jax.custom_vjp
def bad_sin(x):
    return jnp.sin(x)


bad_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (1.1 * g * jnp.cos(x),))  # 10% off
report = fg.check_grads(lambda w: jnp.sum(bad_sin(w)), jnp.array([0.3, 0.7]))
check("check_grads fails a 10% wrong custom rule", not report.ok, str(report).splitlines()[0])

version = subprocess.run(["funcgrad", "--version"], capture_output=True, text=True)
check("funcgrad --version", version.returncode == 0
      and version.stdout.strip() == f"funcgrad {fg.__version__}", version.stdout.strip())
with tempfile.TemporaryDirectory() as out:
    run = subprocess.run(["funcgrad", "train", "--epochs", "1", "--out", out],
                         capture_output=True, text=True)
    metrics = os.path.join(out, "metrics.json")
    check("funcgrad train --epochs 1", run.returncode == 0 and os.path.exists(metrics),
          (run.stdout + run.stderr).strip().splitlines()[-1] if run.stdout + run.stderr else "")
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = json.load(f)
        check("metrics.json has the epoch", bool(rows), str(list(rows)[:3]))

import flax.linen as nn  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


x = jnp.linspace(-1.0, 1.0, 20).reshape(5, 4)
model = fg.interop.from_linen(MLP(), MLP().init(jax.random.key(0), x), rngs=())
loss = model.loss(lambda out, b: fg.softmax_cross_entropy(out, b["y"]))
batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1])}
report = fg.check_grads(loss.bind(), model.params, batch)
check("funcgrad.interop: a flax linen model's gradient checks", report.ok,
      f"{len(report.rows)} leaves, e.g. {report.rows[0].path}")

if failures:
    print(f"smoke test FAILED: {len(failures)} check(s): {', '.join(failures)}")
    sys.exit(1)
print("smoke test passed")
