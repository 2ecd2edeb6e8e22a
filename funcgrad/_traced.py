"""One error for a traced value used as a Python value, naming the user's line (private).

Every funcgrad tool traces the user's function (``jax.make_jaxpr``, ``jax.jit``, ``jax.vjp``),
so inside it the arguments are abstract arrays: a Python ``if x > 0:``, ``range(n)``,
``float(x)`` or ``np.sum(x)`` on one of them raises one of JAX's concretization errors, which
name funcgrad's own frames (``check.py``, ``state.params``) rather than the user's line.
`traced_values` catches those errors where a tool traces the user's function, finds the user's
frame in the traceback (the innermost one outside funcgrad, JAX and the standard library) and
raises `TracedValueError` naming that file, line and code, with the fix that applies:

* the value depends on an argument the tool differentiates: it must stay traced, so the
  branch becomes ``jnp.where`` / ``jax.lax.cond`` (a loop ``jax.lax.fori_loop``);
  ``functools.partial`` or ``static_argnums`` would freeze the very value being differentiated;
* it depends only on arguments that are not differentiated: if such an argument is a setting
  (a count, a flag), close over it with ``functools.partial`` (``static_argnums`` under one's
  own ``jax.jit``); if it is data, keep the branch traced as above.

Which arguments the value depends on is found on the error path only: the function is traced
again, the refused tracer is taken from the failing frame and returned as the output, and the
jaxpr says which arguments it is computed from (this works inside someone else's trace too,
such as the jitted train step).
"""
from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import jax
import jax.extend
import jax.numpy as jnp

from funcgrad._jaxpr import leaf_paths

#: JAX's errors for a traced value used where Python needs a concrete one. (A TypeError that
#: mentions a "concrete value", e.g. ``jnp.ones(n)`` with `n` traced, is one too.)
_CONCRETE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                    jax.errors.TracerArrayConversionError)

_FUNCGRAD_DIR = os.path.dirname(os.path.abspath(__file__))
_JAX_DIRS = tuple(os.path.dirname(os.path.abspath(cast(str, m.__file__)))
                  for m in (jax, jax.numpy)) + (
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(jax.__file__))), "jaxlib"),)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})


class TracedValueError(TypeError):
    """A traced value was used as a Python value (``if``, ``range``, ``float``, NumPy) inside
    the user's function; the message names the user's line and the fix. JAX's original error
    is kept as ``jax_error`` (and as ``__context__``)."""

    def __init__(self, message: str, jax_error: BaseException, where: str):
        super().__init__(message)
        self.jax_error = jax_error
        self.where = where


def _is_concrete_error(error: BaseException) -> bool:
    if isinstance(error, TracedValueError):
        return False
    if isinstance(error, _CONCRETE_ERRORS):
        return True
    return isinstance(error, TypeError) and "concrete value" in str(error)


def _user_frame(error: BaseException):
    """The innermost traceback frame of the user's code, or None.

    Frames of funcgrad, JAX and the standard library are skipped; a frame of an installed
    library (flax, equinox) is taken only when no frame outside site-packages remains."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    own, installed = [], []
    for file, line, name in frames:
        path = os.path.abspath(file)
        if (file.startswith("<frozen") or path.startswith(_FUNCGRAD_DIR + os.sep)
                or path.startswith(_JAX_DIRS)):
            continue
        if path.startswith(_SITE):
            installed.append((file, line, name))
        elif not path.startswith(_STDLIB + os.sep):
            own.append((file, line, name))
    found = own or installed
    return found[-1] if found else None


def _what(error: BaseException) -> tuple[str, str]:
    """(what the line did with the traced value, the fix for a value that must stay traced)."""
    if isinstance(error, jax.errors.TracerBoolConversionError):
        return ("uses a traced value as a Python bool (if, while, and/or, assert)",
                "write the branch with jnp.where(pred, a, b) (both sides are computed; the side "
                "not taken gets a zero gradient) or jax.lax.cond(pred, true_fn, false_fn, x)")
    if isinstance(error, jax.errors.TracerIntegerConversionError):
        return ("uses a traced value as a Python int (range(n), an index into a list, a shape)",
                "loop with jax.lax.fori_loop(0, n, body, init), index arrays with x[i] or "
                "jax.lax.dynamic_slice, and keep shapes Python ints")
    if isinstance(error, jax.errors.TracerArrayConversionError):
        return ("converts a traced value to a NumPy array (np.asarray, a NumPy function)",
                "use jax.numpy on traced values (jnp.sum, not np.sum)")
    return ("needs a concrete value of a traced array (float(x), x.item(), a shape from values)",
            "keep it an array (no float(x) or x.item()) and make shapes Python ints")


def _offending_tracer(error: BaseException):
    """The tracer JAX refused to convert: a Tracer among the locals of the innermost frame of
    `error`'s (unfiltered) traceback that holds one (``self`` in ``Tracer.__bool__``), or None."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        tracers = {k: v for k, v in frame.f_locals.items() if isinstance(v, jax.core.Tracer)}
        for name in ("self", "tracer", "val", "x", *tracers):
            if name in tracers:
                return tracers[name]
    return None


def _culprits(fn: Callable, args: tuple, where) -> tuple[str | None, list[int]]:
    """("arguments", the flat positions (in ``jax.tree.leaves(args)``) of the argument leaves
    the refused value depends on), ("inside", []) when fn traces it itself (its own jax.jit),
    or (None, []) when unknown.

    fn is traced again with `jax.make_jaxpr` on `args` (concrete or traced: tracing works on
    either); when the same line fails, the refused tracer is returned as the output, and the
    arguments it depends on are read off the jaxpr (an equation's outputs depend on all its
    inputs: a nested jit counts whole)."""
    leaves, tree = jax.tree.flatten(tuple(args))
    caught = []

    def probe(*flat):
        try:
            fn(*jax.tree.unflatten(tree, flat))
        except TypeError as error:
            tracer = _offending_tracer(error) if _is_concrete_error(error) else None
            if tracer is None or _user_frame(error) != where:
                raise
            caught.append(True)
            return tracer
        return jnp.zeros(())

    try:
        jaxpr = jax.make_jaxpr(probe)(*leaves).jaxpr
    except Exception:  # noqa: BLE001 - an escaped tracer (fn's own jit) or another failure
        return ("inside", []) if caught else (None, [])
    if not caught:
        return None, []
    needed = {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    return "arguments", [i for i, v in enumerate(jaxpr.invars) if v in needed]


def explain(where: str, error: BaseException, fn: Callable | None = None, args: tuple = (),
            names: Sequence[str] = (),
            differentiated: Sequence[int] = ()) -> TracedValueError | None:
    """The `TracedValueError` for JAX's `error` raised while `where` traced ``fn(*args)``, or
    None when `error` is not a traced-value error or no frame of the user's is in its traceback.

    Args:
      where: the tool's name, e.g. "check_grads".
      error: the exception caught.
      fn, args: the user's function and its positional arguments (concrete or traced), used to
        find which arguments the value depends on; without `fn` the fix names both cases.
      names: the arguments' names (`funcgrad._jaxpr.arg_names`).
      differentiated: positions of the arguments `where` differentiates.
    """
    if not _is_concrete_error(error):
        return None
    frame = _user_frame(error)
    if frame is None:
        return None
    file, line, func = frame
    code = linecache.getline(file, line).strip()
    did, traced_fix = _what(error)
    names = list(names) + [f"args[{i}]" for i in range(len(names), len(args))]
    kind, leaves = _culprits(fn, tuple(args), frame) if fn else (None, [])
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    owner = [path[0].idx for path, _ in flat]
    paths = leaf_paths(tuple(args), names) if flat else []
    found: list = []
    if kind == "arguments":
        diff = sorted({owner[i] for i in leaves if owner[i] in differentiated})
        kind, found = (("differentiated", [names[i] for i in diff]) if diff else
                       ("other", [paths[i] for i in leaves]))
        if not found:  # depends on no argument (a constant): nothing to close over
            kind = None
    listed = " and ".join(found)
    if kind == "other" and found[0] in names:  # a whole argument: close over it by name
        static_fix = (f"close over it, e.g. functools.partial(fn, {found[0]}=...), and pass "
                      "only the arrays (under your own jax.jit: static_argnums)")
    elif kind == "other":
        static_fix = (f"take {found[0]} out of the arguments and close over it "
                      "(functools.partial(fn, n=...), or a Python constant in fn); pass only "
                      "arrays (under your own jax.jit: static_argnums)")
    else:
        static_fix = ("close over it, e.g. functools.partial(fn, n=...), and pass only the "
                      "arrays (under your own jax.jit: static_argnums)")
    if kind == "inside":
        fix = ("The value is traced inside the function itself, whatever its arguments (a "
               "jax.jit, jax.vmap or lax loop in it, or a value built from one): "
               f"{traced_fix}; or, for a setting, mark it static in that jax.jit "
               "(static_argnums) or close over it.")
    elif kind == "differentiated":
        fix = (f"The value depends on {listed}, which {where} differentiates, so it must stay "
               f"traced (functools.partial or static_argnums would freeze the very value being "
               f"differentiated): {traced_fix}.")
    elif kind == "other":
        fix = (f"The value depends on {listed}, which {where} does not differentiate. If it is "
               f"a setting (a count, a flag), {static_fix}; if it is "
               f"data, keep it traced: {traced_fix}.")
    else:
        diffed = ", ".join(names[i] for i in differentiated if i < len(names)) or "the arguments"
        fix = (f"If the value is computed from {diffed} (what {where} differentiates), it must "
               f"stay traced: {traced_fix}. If it is a setting passed as an argument (a count, "
               f"a flag), {static_fix}.")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    message = (f"{where}: {file}:{line} ({func}) {did}:\n" + (f"    {code}\n" if code else "")
               + f"{where} traces the function as jax.jit does: its arguments are abstract "
               "arrays (shapes and dtypes, no values), so Python cannot branch, loop or convert "
               f"on them. {fix}\n(JAX's message: {first})")
    return TracedValueError(message, error, f"{file}:{line}")


@contextlib.contextmanager
def traced_values(where: str, fn: Callable | None = None, args: tuple = (),
                  names: Sequence[str] = (), differentiated: Sequence[int] = ()) -> Iterator[None]:
    """Turns JAX's traced-value errors raised inside the block into `TracedValueError`s that
    name the user's line (see `explain`); other errors pass through unchanged."""
    try:
        yield
    except TypeError as error:
        clear = explain(where, error, fn, args, names, differentiated)
        if clear is None:
            raise
        raise clear from None


def naming_traced_values(fn: Callable, where: str, names: Sequence[str] = (),
                         differentiated: Sequence[int] = ()) -> Callable:
    """`fn` with its calls inside `traced_values` (for a function traced by someone else's
    jit, such as the train step's loss)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bound = functools.partial(fn, **kwargs) if kwargs else fn
        with traced_values(where, bound, args, names, differentiated):
            return fn(*args, **kwargs)
    return wrapped
