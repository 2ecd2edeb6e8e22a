"""One test per accessor of `funcgrad._jax_internals`, the one module that reads JAX's
internals. CI runs this file on every JAX of the tested range (Python 3.11 -> jax 0.10.2,
Python 3.13 -> jax 0.12.0.1); each expected value is written from the program traced (how many
consts, carries, branches the user's code has), not from what JAX happens to store."""
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg
from funcgrad import _jax_internals as ji


def _eqns(fn, *args, kind=None):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e for e in jaxpr.eqns if kind is None or ji.kind(e) == kind]


def test_scan_parts_count_consts_carries_and_xs():
    c1, c2 = jnp.arange(3.0), jnp.float32(2.0)

    def f(x, h0):
        def body(carry, xs):  # closes over c1 and c2: two consts; two carries; one xs
            h, k = carry
            return (h * c1 + xs * c2, k + 1.0), h.sum()
        return jax.lax.scan(body, (h0, jnp.float32(0.0)), x, reverse=True)

    (eqn,) = _eqns(f, jnp.ones((4, 3)), jnp.ones(3), kind="scan")
    s = ji.scan(eqn)
    assert (s.num_consts, s.num_carry, s.length, s.reverse) == (2, 2, 4, True)
    # Inputs are consts + carries + xs; the body's outputs carries + ys.
    assert len(eqn.invars) == s.num_consts + s.num_carry + 1
    assert len(s.body.invars) == len(eqn.invars)
    assert len(s.body.outvars) == s.num_carry + 1
    # The body evaluates to the loop's step: one iteration by hand.
    consts = [np.arange(3.0), np.float32(2.0)][: s.num_consts]
    out = ji.as_fun(s.body, s.body_consts)(*consts, np.ones(3, np.float32), np.float32(0.0),
                                           np.full(3, 5.0, np.float32))
    np.testing.assert_allclose(out[0], np.arange(3.0) + 10.0)  # h * c1 + xs * c2
    assert float(out[2]) == 3.0  # h.sum()


def test_scan_without_consts():
    (eqn,) = _eqns(lambda x: jax.lax.scan(lambda c, y: (c + y, c), 0.0, x), jnp.ones(5),
                   kind="scan")
    s = ji.scan(eqn)
    assert (s.num_consts, s.num_carry, s.length, s.reverse) == (0, 1, 5, False)


def test_cond_branches_in_index_order():
    def f(i, x):
        return jax.lax.switch(i, [jnp.sin, jnp.cos, lambda z: z * 3.0], x)

    (eqn,) = _eqns(f, 1, jnp.float32(0.5), kind="cond")
    branches = ji.cond_branches(eqn)
    assert len(branches) == 3
    got = [float(ji.as_fun(*b)(np.float32(0.5))[0]) for b in branches]
    np.testing.assert_allclose(got, [np.sin(0.5), np.cos(0.5), 1.5], rtol=1e-6)


def test_while_loop_parts():
    c = jnp.float32(2.0)

    def f(x):  # the body closes over c: one body const; the condition over nothing
        return jax.lax.while_loop(lambda s: s < 10.0, lambda s: s * c, x)

    (eqn,) = _eqns(f, jnp.float32(1.0), kind="while")
    w = ji.while_loop(eqn)
    assert (w.cond_nconsts, w.body_nconsts) == (0, 1)
    assert float(ji.as_fun(w.body, w.body_consts)(np.float32(2.0), np.float32(3.0))[0]) == 6.0
    assert bool(ji.as_fun(w.cond, w.cond_consts)(np.float32(3.0))[0])


def test_call_bodies_and_kinds():
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2.0

    def f(x):
        return inner(x) + jax.checkpoint(jnp.cos)(x)

    eqns = _eqns(f, jnp.ones(3))
    kinds = [ji.kind(e) for e in eqns]
    assert "jit" in kinds and "checkpoint" in kinds
    jit_eqn = eqns[kinds.index("jit")]
    body, consts = ji.body(jit_eqn)
    assert [ji.name(e) for e in body.eqns] == ["sin", "mul"]
    assert ji.function_name(jit_eqn) == "inner"
    ck = ji.checkpoint(eqns[kinds.index("checkpoint")])
    assert [ji.name(e) for e in ck.body.eqns] == ["cos"] and ck.policy is None
    assert ck.prevent_cse is True
    assert ji.body(eqns[kinds.index("add")]) is None  # a primitive has no body
    assert [ji.name(e) for e in ji.call_body(jit_eqn)[0].eqns] == ["sin", "mul"]
    with pytest.raises(ValueError, match="add is not a call-like equation"):
        ji.call_body(eqns[kinds.index("add")])


def test_custom_jvp_and_vjp_rules():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)
    f.defjvp(lambda p, t: (jnp.sin(p[0]), 3.0 * t[0]))  # a deliberately odd rule: 3 t

    @jax.custom_vjp
    def g(x, y):
        return x * y
    g.defvjp(lambda x, y: (x * y, (x, y)), lambda r, ct: (ct * r[1] * 5.0, None))

    (jvp_eqn,) = _eqns(f, jnp.float32(0.3), kind="custom_jvp")
    rule = ji.custom_jvp(jvp_eqn)
    assert rule.num_consts == 0
    jaxpr, consts, out_zeros = rule.jvp_jaxpr_fun.call_wrapped(False)
    jaxpr, consts = ji.attach_consts(jaxpr, consts)
    primal, tangent = ji.as_fun(jaxpr, consts)(np.float32(0.3), np.float32(2.0))
    assert float(tangent) == 6.0 and out_zeros == [False]
    assert [ji.name(e) for e in ji.body(jvp_eqn)[0].eqns] == ["sin"]

    (vjp_eqn,) = _eqns(g, jnp.float32(2.0), jnp.float32(7.0), kind="custom_vjp")
    rule = ji.custom_vjp(vjp_eqn)
    assert rule.num_consts == 0
    fwd, fwd_consts = ji.attach_consts(*rule.fwd_jaxpr_thunk.call_wrapped(True, True))
    out = ji.as_fun(fwd, fwd_consts)(np.float32(2.0), np.float32(7.0))
    n_res, forwards = rule.residual_layout()
    # Both residuals are inputs (x, y), forwarded rather than returned: none computed.
    assert (n_res, forwards) == (0, [0, 1]) and float(out[-1]) == 14.0
    cts = rule.call_bwd(2, np.float32(2.0), np.float32(7.0), np.float32(1.0))
    assert float(cts[0]) == 35.0  # ct * y * 5
    assert rule.user_bwd() is not None


def test_params_raise_funcgrads_error_naming_the_version():
    (eqn,) = _eqns(lambda x: jnp.sum(x, axis=0), jnp.ones((2, 3)))
    assert tuple(ji.params(eqn)["axes"]) == (0,)
    assert ji.params(eqn).get("no_such_parameter", "d") == "d"
    with pytest.raises(fg.JaxInternalsError, match=rf"'no_such'.*'reduce_sum'.*jax "
                                                    rf"{jax.__version__}.*tested on jax"):
        ji.params(eqn)["no_such"]
    with pytest.raises(fg.JaxInternalsError, match="'jaxpr'.*'reduce_sum'"):
        ji.scan(eqn)  # not a scan: no body


def test_literals_and_dropvars():
    jaxpr = jax.make_jaxpr(lambda x: jnp.maximum(x, 0.0))(jnp.ones(3)).jaxpr
    (eqn,) = jaxpr.eqns
    assert [ji.is_literal(v) for v in eqn.invars] == [False, True]
    # A DropVar (an output nothing reads, made by JAX's dead-code elimination) is one; an
    # equation's ordinary output is not.
    from jax.extend import core
    assert ji.is_dropvar(core.DropVar(eqn.outvars[0].aval))
    assert not ji.is_dropvar(eqn.outvars[0])


def test_sub_jaxprs_and_closed_parts():
    def f(x):
        return jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)

    (eqn,) = _eqns(f, jnp.float32(1.0), kind="cond")
    names = [n for n, _, _ in ji.sub_jaxprs(eqn)]
    assert names == ["branches[0]", "branches[1]"]
    closed = jax.make_jaxpr(lambda x: x * jnp.float32(2.0))(jnp.float32(1.0))
    jaxpr, consts = ji.closed_parts(closed)
    assert float(ji.as_fun(jaxpr, consts)(np.float32(3.0))[0]) == 6.0
    with pytest.raises(fg.JaxInternalsError, match="a jaxpr"):
        ji.closed_parts(42)


def test_source_summary_and_transpose_flag():
    def f(x):
        return jnp.sin(x)  # this line is the equation's source

    jaxpr = jax.make_jaxpr(jax.grad(f))(jnp.float32(1.0)).jaxpr
    assert any("test_jax_internals.py" in ji.source_summary(e) for e in jaxpr.eqns)
    forward = jax.make_jaxpr(f)(jnp.float32(1.0)).jaxpr.eqns
    assert not any(ji.in_transpose(e) for e in forward)
    # jax.grad's program: the backward's mul by cos is made by transposing the jvp.
    assert any(ji.in_transpose(e) for e in jaxpr.eqns)


def test_checkpoint_policy_names():
    assert re.search("DotsSaveable|dots_saveable",
                     ji.policy_name(jax.checkpoint_policies.dots_saveable))
    named = ji.policy_name(jax.checkpoint_policies.save_only_these_names("h1", "h2"))
    assert "'h1'" in named and "'h2'" in named and "0x" not in named


def test_saved_residuals_and_tracer_types():
    rows = ji.saved_residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(3))
    # sin's vjp keeps cos(x), or x to recompute it: one (3,) float32 value either way.
    assert [tuple(a.shape) for a, _ in rows] == [(3,)]
    jvp_tracer, batch_tracer = ji.tracer_types()
    seen = []
    jax.jvp(lambda x: seen.append(type(x)) or x, (1.0,), (1.0,))
    jax.vmap(lambda x: seen.append(type(x)) or x)(jnp.ones(2))
    assert issubclass(seen[0], jvp_tracer) and issubclass(seen[1], batch_tracer)


def test_memory_stats_of_a_compiled_program():
    x = jnp.ones((16, 32), jnp.float32)  # 2048 B in, the same shape out
    compiled = jax.jit(lambda a: a * 2.0).lower(x).compile()
    m = ji.memory_stats(compiled)
    assert m is not None and (m.argument_bytes, m.output_bytes) == (2048, 2048)
    assert m.temp_bytes >= 0 and m.alias_bytes == 0
    assert "multiply" in ji.compiled_text(compiled)


def test_version_range_and_warning(monkeypatch):
    from funcgrad import _jax_version as jv  # the tested range, apart from the accessors

    assert jv.untested_reason(jv.TESTED_JAX[0]) is None
    assert jv.untested_reason(jv.TESTED_JAX[-1]) is None
    assert "older" in jv.untested_reason("0.9.0") and "0.10.2" in jv.untested_reason("0.9.0")
    newer = jv.untested_reason("0.13.0")
    assert "newer" in newer and "jax<0.13" in newer
    # The installed JAX is in the tested range (CI runs both ends): no warning at import.
    assert jv.untested_reason() is None, jv.untested_reason()
    monkeypatch.setattr(jv, "jax_version", lambda: "0.99.0")
    with pytest.warns(fg.JaxVersionWarning, match="tested on jax 0.10.2 to 0.12.x"):
        jv.warn_if_untested()
    monkeypatch.setenv("FUNCGRAD_NO_VERSION_WARNING", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jv.warn_if_untested()


def test_only_the_internals_module_reads_jax_internals():
    # Every read of an equation's parameters or a private JAX module goes through
    # funcgrad._jax_internals: scan the package's source for the patterns that bypass it.
    import pathlib
    import re as re_
    root = pathlib.Path(importlib.import_module("funcgrad").__file__).parent
    bypass = re_.compile(r"\.params\[|\.params\.get\(|\beqn\.params\b|from jax\._src|"
                         r"memory_analysis\(\)\.|\.primitive\.name")
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_jax_internals.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if bypass.search(code) and "``" not in code:
                offenders.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)

