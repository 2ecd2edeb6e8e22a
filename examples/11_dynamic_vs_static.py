"""Dynamic vs static graphs: eager Python, tracing, retracing and lax.cond (A §1.2, B §1.3).

PyTorch rebuilds its tape on every forward pass, so Python control flow just works. JAX runs
eagerly the same way, but ``jax.jit`` traces the function once per input shape and dtype into
a static program: Python code runs only while tracing, and a Python ``if`` on a traced value
cannot be decided. The fix is to make the branch part of the program (``lax.cond`` /
``jnp.where``) or to make the value static (``static_argnums``: one trace per value).

Function used throughout:  f(x) = x² if x > 0 else -x
    f(3) = 9, f'(3) = 2x = 6;    f(-2) = 2, f'(-2) = -1.

    $ python examples/11_dynamic_vs_static.py
"""
import jax
import jax.numpy as jnp
from _check import Check

TRACES = {"python_if": 0, "cond": 0, "static": 0}


def f_python_if(x):
    TRACES["python_if"] += 1      # runs on every eager call, and once per trace under jit
    return x ** 2 if x > 0 else -x


def f_cond(x):
    TRACES["cond"] += 1
    return jax.lax.cond(x > 0, lambda v: v ** 2, lambda v: -v, x)


def f_static(x, positive):
    TRACES["static"] += 1
    return x ** 2 if positive else -x


def main() -> None:
    c = Check("f(x) = x² if x > 0 else -x, and its gradient")
    # 1. Eager: like PyTorch, each call runs the Python code again (a "dynamic graph").
    c.row("eager f(3)", f_python_if(3.0), 9.0)
    c.row("eager f'(3)", jax.grad(f_python_if)(3.0), 6.0)
    c.row("eager f'(-2)", jax.grad(f_python_if)(-2.0), -1.0)
    # jax.grad traces too, but with concrete values it can decide the if (no jit involved).

    # 2. Under jit the value is abstract while tracing: the Python if fails, with this error.
    try:
        jax.jit(f_python_if)(3.0)
        error = ""
    except jax.errors.TracerBoolConversionError as e:
        error = type(e).__name__
        print("  jit(f_python_if)(3.0) raises", error + ":", str(e).splitlines()[0])
    c.same("jit + Python if on a traced value", error, "TracerBoolConversionError")

    # 3. The branch inside the program: lax.cond. Traced once, then reused for any value.
    g = jax.jit(jax.value_and_grad(f_cond))
    (v3, d3), (v2, d2) = g(3.0), g(-2.0)
    c.row("jit lax.cond f(3)", v3, 9.0)
    c.row("jit lax.cond f'(3)", d3, 6.0)
    c.row("jit lax.cond f(-2)", v2, 2.0)
    c.row("jit lax.cond f'(-2)", d2, -1.0)
    c.same("traces of the lax.cond version", TRACES["cond"], 1)
    # A new abstract value is a new static program: one more trace each. A Python float is a
    # *weakly typed* float32, so a strongly typed jnp.float32 scalar is new (trace 2), and so is
    # a float16 one (trace 3); calling again with either reuses its trace.
    g(jnp.float32(1.0)), g(jnp.ones((), jnp.float16)), g(jnp.float32(7.0))
    c.same("traces after f32, f16, f32 calls", TRACES["cond"], 3)

    # 4. A static argument: the Python if is decided at trace time, one trace per value.
    h = jax.jit(jax.grad(f_static), static_argnums=1)
    c.row("static positive=True f'(3)", h(3.0, True), 6.0)
    c.row("static positive=False f'(-2)", h(-2.0, False), -1.0)
    h(5.0, True)  # same static value, same shape: cached, no new trace
    c.same("traces for 2 static values, 3 calls", TRACES["static"], 2)
    c.done()


if __name__ == "__main__":
    main()
