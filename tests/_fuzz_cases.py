"""The fuzz harness: hypothesis draws calls of funcgrad's public tools, and each outcome is
judged against an answer derived without funcgrad (jax.grad, the function's own value, the
arguments' shapes) or classified by where its exception was raised.

Used by tests/test_fuzz.py (the suite's budget) and benchmarks/fuzz.py (a larger run).

A drawn case is a tuple of positional arguments built from leaf kinds (Python scalars, 0-d,
empty and small arrays, int and bool arrays, typed and raw keys, None, bfloat16/float16/float64
leaves, an unregistered dataclass) inside containers (tuples, dicts, NamedTuples, registered
and unregistered dataclasses), and a function of them built from jnp ops: every leaf adds one
float32 term to a vector ``v`` (a float leaf ``sum(1.5 sin x + x**2 / 2)``, an integer or bool
leaf ``0.25 sum(x)``, a key ``uniform(key)``), and the output is ``sum(v**2) / 2``, ``v**2``,
``(sum(v**2) / 2, aux)``, that pair without ``has_aux``, an int or a Python float constant.

Outcomes:
  right: the tool returned, and what it returned agrees with the independent answer.
  clear: the tool raised one of funcgrad's documented exception classes, or a TypeError or
    ValueError raised by funcgrad's own code (the innermost frame of the traceback is a frame
    of the funcgrad package); for `remat`, which is ``jax.checkpoint`` with a different
    mechanism, also the error jax.checkpoint itself raises on the same call.
  user: the user's function raised (only expected where it raises when called directly).
  wrong: the tool returned an answer that disagrees, or accepted what it must refuse.
  crash: any other exception: raised inside funcgrad's helpers or in JAX under them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import traceback
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import funcgrad as fg

FUNCGRAD_DIR = os.path.dirname(os.path.abspath(fg.__file__))
THIS_FILE = os.path.abspath(__file__)
DOCUMENTED = (fg.TracedValueError, fg.LiftError, fg.JaxInternalsError)

# --- leaves ---------------------------------------------------------------------------------

FLOAT_KINDS = ("py_float", "f32_0d", "f32_vec", "f32_empty", "f32_mat", "bf16", "f64")
INT_KINDS = ("py_int", "py_bool", "i32", "bool_arr")
KEY_KINDS = ("key", "raw_key")
OTHER_KINDS = ("none", "opaque")
LEAF_KINDS = FLOAT_KINDS + INT_KINDS + KEY_KINDS + OTHER_KINDS


@dataclasses.dataclass
class Opaque:
    """An unregistered dataclass: to JAX, one leaf that is not an array."""
    w: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Registered:
    a: Any
    b: Any


class Pair(NamedTuple):
    first: Any
    second: Any


def make_leaf(kind: str, seed: int) -> Any:
    """A leaf of `kind`, its values away from 0 (a float leaf's term then has a non-zero
    derivative 1.5 cos x + x at every element: |x| in [0.3, 1.2])."""
    rng = np.random.default_rng(seed)
    vals = (rng.uniform(0.3, 1.2, 4) * rng.choice([-1.0, 1.0], 4)).astype(np.float32)
    return {
        "py_float": float(vals[0]), "f32_0d": jnp.float32(vals[0]),
        "f32_vec": jnp.asarray(vals[:2]), "f32_empty": jnp.zeros((0,), jnp.float32),
        "f32_mat": jnp.asarray(vals.reshape(2, 2)), "bf16": jnp.asarray(vals[:2], jnp.bfloat16),
        "f16": jnp.asarray(vals[:2], jnp.float16), "f64": vals[:2].astype(np.float64),
        "py_int": int(rng.integers(1, 5)), "py_bool": bool(rng.integers(2)),
        "i32": jnp.asarray(rng.integers(0, 5, 2), jnp.int32),
        "bool_arr": jnp.asarray([True, False]), "key": jax.random.key(seed),
        "raw_key": jax.random.PRNGKey(seed), "none": None,
        "opaque": Opaque(jnp.asarray(vals[:2])),
    }[kind]


def leaf_kind(leaf: Any) -> str:
    """The kind of a leaf as the function sees it (inside tools, arrays become tracers)."""
    if isinstance(leaf, Opaque):
        return "opaque"
    if isinstance(leaf, bool) or isinstance(leaf, int):
        return "int"
    if isinstance(leaf, float):
        return "float"
    dtype = jnp.result_type(leaf) if not jax.dtypes.issubdtype(
        getattr(leaf, "dtype", np.float32), jax.dtypes.extended) else leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return "key"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return "int"


def is_float_leaf(leaf: Any) -> bool:
    return leaf_kind(leaf) == "float"


def _term(kind: str, leaf: Any) -> jax.Array:
    """One leaf's float32 contribution to ``v``."""
    if kind == "float":
        x = jnp.asarray(leaf)
        return jnp.sum(1.5 * jnp.sin(x) + 0.5 * x * x).astype(jnp.float32)
    if kind == "int":
        return 0.25 * jnp.sum(jnp.asarray(leaf).astype(jnp.float32))
    if kind == "raw_key":
        return jax.random.uniform(leaf, ())
    if kind == "key":
        return jax.random.uniform(leaf, ())
    if kind == "opaque":
        return jnp.sum(leaf.w)
    raise AssertionError(kind)


# --- cases ------------------------------------------------------------------------------------

OUT_KINDS = ("scalar", "vector", "aux", "pair_no_aux", "int", "const")
PLANT_LINE = 0  # set below: the line of the planted log(0)


@dataclasses.dataclass
class Case:
    args: tuple
    argnums: Any          # int or tuple of ints
    out: str              # one of OUT_KINDS
    kinds: list[str]      # per flat leaf: "float", "int", "key", "raw_key", "opaque"
    plant: bool = False   # add log(0) = -inf to v at PLANT_LINE
    tap: str = ""         # "": no tap; "v": tap("h", v); "int": tap("h", an int array)

    @property
    def has_aux(self) -> bool:
        return self.out == "aux"

    @property
    def nums(self) -> tuple[int, ...]:
        return (self.argnums,) if isinstance(self.argnums, int) else tuple(self.argnums)

    def describe(self) -> str:
        return (f"out={self.out} argnums={self.argnums} plant={self.plant} tap={self.tap!r} "
                f"args={jax.tree.map(_short, self.args, is_leaf=lambda x: x is None)}")

    def fn(self):
        return make_fn(self)


def _short(x):
    if x is None or isinstance(x, (bool, int, float, Opaque)):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def make_fn(case: Case):
    kinds, out, plant, tap = case.kinds, case.out, case.plant, case.tap

    def fn(*args):
        terms = [_term(k, leaf) for k, leaf in zip(kinds, jax.tree.leaves(args))]
        v = jnp.stack(terms) if terms else jnp.zeros((1,), jnp.float32)
        if plant:
            v = v + jnp.log(v[0] * 0.0)  # <- plant
        if tap == "v":
            v = fg.tap("h", v)
        elif tap == "int":
            fg.tap("h", jnp.arange(3))
        if out == "scalar":
            return 0.5 * jnp.sum(v * v)
        if out == "vector":
            return v * v
        if out in ("aux", "pair_no_aux"):
            return 0.5 * jnp.sum(v * v), {"v": v, "n": jnp.int32(3)}
        if out == "int":
            return jnp.sum(v * v).astype(jnp.int32)
        return 2.0  # "const"

    return fn


with open(THIS_FILE, encoding="utf-8") as _f:
    PLANT_LINE = next(i + 1 for i, text in enumerate(_f) if text.rstrip().endswith("# <- plant"))


def _container(draw, leaves: list) -> Any:
    """Wraps `leaves` (a list) in a random container, nesting once more at random."""
    kind = draw(st.sampled_from(["tuple", "dict", "namedtuple", "registered", "list", "nested"] * 3
                                + ["unregistered"]))
    if kind == "tuple":
        return tuple(leaves)
    if kind == "list":
        return list(leaves)
    if kind == "dict":
        return {f"k{i}": x for i, x in enumerate(leaves)}
    if kind == "namedtuple":
        return Pair(leaves[0] if leaves else None, tuple(leaves[1:]))
    if kind == "registered":
        return Registered(leaves[0] if leaves else None, {"rest": tuple(leaves[1:])})
    if kind == "unregistered":
        return Opaque(tuple(leaves))
    half = len(leaves) // 2
    return {"outer": (tuple(leaves[:half]), {"inner": leaves[half:]})}


@st.composite
def cases(draw, *, float16: bool = False, outs: tuple[str, ...] = OUT_KINDS,
          leaf_kinds: tuple[str, ...] = LEAF_KINDS, max_args: int = 3) -> Case:
    """A case: 1..max_args positional arguments, each a container or a bare leaf."""
    # Opaque leaves and unregistered containers are refused by every tool: drawn rarely, so
    # that most calls reach an answer.
    pool = tuple(k for k in leaf_kinds for _ in range(1 if k == "opaque" else 3)) + (
        ("f16",) if float16 else ())
    nargs = draw(st.integers(1, max_args))
    seed = draw(st.integers(0, 7))
    args = []
    for a in range(nargs):
        kinds = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=4))
        if float16 and a == 0 and "f16" not in kinds:
            kinds = ["f16"] + kinds
        leaves = [make_leaf(k, seed + 10 * a + i) for i, k in enumerate(kinds)]
        bare = len(leaves) == 1 and draw(st.booleans())
        args.append(leaves[0] if bare else _container(draw, leaves))
    args_t = tuple(args)
    kinds = []
    for leaf in jax.tree.leaves(args_t):
        kind = leaf_kind(leaf)
        if kind == "int" and getattr(leaf, "dtype", None) == jnp.uint32 and np.shape(leaf) == (2,):
            kind = "raw_key"  # a raw key is a uint32[2]; make_leaf's i32 is int32
        kinds.append(kind)
    argnums = draw(st.sampled_from([0, 0, 0, (0,), tuple(range(nargs)), -1]))
    out = draw(st.sampled_from(outs))
    return Case(args_t, argnums, out, kinds, plant=draw(st.booleans()) and draw(st.booleans()),
                tap=draw(st.sampled_from(["", "", "v", "int"])))


# --- independent answers ----------------------------------------------------------------------

def owners(args: tuple) -> list[int]:
    """The argument index of each flat leaf."""
    return [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


def float_grads(fn, case: Case, loss_of=None) -> dict[int, Any]:
    """jax.grad of the loss with respect to each real floating leaf of `argnums` (flat index ->
    gradient), the other leaves held fixed: what every tool's gradient must equal."""
    flat, treedef = jax.tree.flatten(case.args)
    nums = {n % len(case.args) for n in case.nums}
    idx = [j for j, (o, leaf) in enumerate(zip(owners(case.args), flat))
           if o in nums and is_float_leaf(leaf)]
    loss_of = loss_of or (lambda out: out[0] if case.has_aux else out)

    def loss(*xs):
        leaves = list(flat)
        for j, x in zip(idx, xs):
            leaves[j] = x
        return loss_of(fn(*jax.tree.unflatten(treedef, leaves)))

    if not idx:
        return {}
    grads = jax.grad(loss, argnums=tuple(range(len(idx))))(*[flat[j] for j in idx])
    return dict(zip(idx, grads))


def close(a, b, rtol=1e-5, atol=1e-6) -> bool:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def tree_close(a, b, rtol=1e-5, atol=1e-6) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(close(x, y, rtol, atol) for x, y in zip(la, lb))


# --- classifying an exception ------------------------------------------------------------------

def classify(error: BaseException) -> tuple[str, str]:
    """("clear" | "user" | "crash", where): where the exception was raised, by its traceback
    (run with JAX's traceback filtering off, so JAX's own frames are kept)."""
    frames = traceback.extract_tb(error.__traceback__)
    inner = frames[-1] if frames else None
    where = f"{os.path.relpath(inner.filename, os.path.dirname(FUNCGRAD_DIR))}:{inner.lineno}" \
        if inner else "?"
    if isinstance(error, DOCUMENTED):
        return "clear", where
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(FUNCGRAD_DIR + os.sep)
            or os.path.abspath(f.filename) == THIS_FILE]
    last = ours[-1] if ours else None
    if last is not None and os.path.abspath(last.filename) == THIS_FILE:
        return "user", where
    if (inner is not None and last is inner and type(error) in (TypeError, ValueError)
            and len(str(error)) > 40):
        return "clear", where
    return "crash", where


class Outcome(NamedTuple):
    kind: str      # right | clear | user | wrong | crash
    detail: str


def judged(tool: str, case: Case, run) -> Outcome:
    """Runs `run()` (which returns an error string when its answer is wrong, else None) and
    classifies what happened."""
    previous = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        problem = run()
    except Exception as error:  # noqa: BLE001 - every exception is classified
        kind, where = classify(error)
        if kind == "user" and _raises_directly(case):
            kind = "clear"
        return Outcome(kind if kind != "user" else "crash",
                       f"{type(error).__name__} at {where}: {str(error)[:300]}")
    finally:
        jax.config.update("jax_traceback_filtering", previous)
    if problem and problem.startswith(AS_JAX):  # the error the plain JAX/library call raises
        return Outcome("clear", problem)
    return Outcome("wrong", problem) if problem else Outcome("right", "")


AS_JAX = "the same error as "


def _raises_directly(case: Case) -> bool:
    try:
        case.fn()(*case.args)
    except Exception:  # noqa: BLE001
        return True
    return False


# --- the tools --------------------------------------------------------------------------------

def _scalar_out(case: Case) -> bool:
    return case.out in ("scalar", "aux", "const")  # a Python float constant is a scalar loss


def _value(case: Case):
    out = case.fn()(*case.args)
    return out[0] if case.has_aux else out


def _arg_grads_ok(case: Case, grads_of_nums, oracle: dict[int, Any]) -> str | None:
    """Compares a tool's gradient (the structure of args[argnums], a tuple when argnums is a
    tuple) with the oracle, leaf by leaf at the floating leaves."""
    nums = [n % len(case.args) for n in case.nums]
    per_arg = (grads_of_nums,) if isinstance(case.argnums, int) else tuple(grads_of_nums)
    flat_owner = owners(case.args)
    flat = jax.tree.leaves(case.args)
    for n, g in zip(nums, per_arg):
        mine = [j for j, o in enumerate(flat_owner) if o == n]
        got = jax.tree.leaves(g)
        if len(got) != len(mine):
            return f"gradient of argument {n} has {len(got)} leaves, expected {len(mine)}"
        for j, x in zip(mine, got):
            if j in oracle and not close(x, oracle[j], rtol=rtol_of(flat[j])):
                return f"gradient of flat leaf {j}: {x} != jax.grad's {oracle[j]}"
    return None


def rtol_of(leaf) -> float:
    """The relative tolerance between two gradients of the same function computed along
    different paths (remat's recomputation, a tool's own evaluator): a few roundings of the
    leaf's dtype (bfloat16 keeps 8 significant bits, 2**-8 = 0.4% each; float16 11 bits), and
    1e-5 (about 80 float32 roundings of 2**-24) otherwise."""
    dtype = getattr(leaf, "dtype", None)
    return {"bfloat16": 3e-2, "float16": 4e-3}.get(str(dtype), 1e-5)


def case_rtol(case: Case) -> float:
    """The loosest `rtol_of` over the case's leaves: for its value, which every leaf feeds (a
    jitted bfloat16 sum and an op-by-op one round differently)."""
    return max([rtol_of(leaf) for leaf in jax.tree.leaves(case.args)], default=1e-5)


def run_check_grads(case: Case, check=fg.check_grads) -> Outcome:
    def run():
        report = check(case.fn(), *case.args, argnums=case.argnums, has_aux=case.has_aux)
        if _must_refuse(case):
            return None if not report.ok else f"accepted out={case.out} plant={case.plant}: " \
                f"{report}"
        return None if report.ok else f"a correct function failed the check:\n{report}"
    return judged("check_grads", case, run)


def _must_refuse(case: Case) -> bool:
    """An integer output has no gradient to check, and a planted -inf in the output cannot
    pass. (A (loss, aux) pair without has_aux is checked whole, as uT J with a note: a
    correct function, which passes; a constant output does not see the plant.)"""
    return case.out == "int" or (case.plant and case.out != "const")


def run_directional(case: Case) -> Outcome:
    return run_check_grads(case, check=fg.check_directional)


def run_audit(case: Case) -> Outcome:
    def run():
        report = fg.audit(case.fn(), *case.args, has_aux=case.has_aux)
        if _must_refuse(case):
            return None if not report.ok else f"accepted out={case.out} plant={case.plant}: " \
                f"{report}"
        return None if report.ok else f"a correct function failed the audit:\n{report}"
    return judged("audit", case, run)


def run_explain(case: Case) -> Outcome:
    def run():
        report = fg.explain_grads(case.fn(), *case.args, has_aux=case.has_aux)
        if not _scalar_out(case):
            return f"explained a {case.out} output"
        value = float(_value(case))
        if not (math.isclose(report.loss, value, rel_tol=case_rtol(case), abs_tol=1e-6)
                or (math.isnan(value) and math.isnan(report.loss))
                or (math.isinf(value) and report.loss == value)):
            return f"loss {report.loss} != {value}"
        if case.plant:
            return None
        oracle = float_grads(case.fn(), dataclasses.replace(case, argnums=0))
        flat = jax.tree.leaves(case.args)
        want = sum(1 for j, g in oracle.items() if np.size(flat[j]) and np.any(np.asarray(g)))
        got = sum(1 for r in report.rows if r.status == "connected")
        return None if got == want else f"{got} connected rows, expected {want}:\n{report}"
    return judged("explain_grads", case, run)


def run_find_nonfinite(case: Case) -> Outcome:
    from funcgrad.debug.anomaly import _locate

    grad = _scalar_out(case)

    def run():
        report, values, grads = _locate(case.fn(), case.args, argnums=case.argnums, grad=grad,
                                        has_aux=case.has_aux)
        if case.plant and case.out not in ("int", "const"):
            if (report.phase, report.primitive, report.line) != ("forward", "log", PLANT_LINE):
                return f"the planted log(0) at line {PLANT_LINE} was not found:\n{report}"
            return None
        if not report.ok:
            return f"a finite function was reported:\n{report}"
        if grad:
            oracle = float_grads(case.fn(), case)
            flat = jax.tree.leaves(case.args)
            for j, g in enumerate(grads):
                if j in oracle and not close(g, oracle[j], rtol=rtol_of(flat[j])):
                    return f"gradient of flat leaf {j}: {g} != jax.grad's {oracle[j]}"
        return None
    return judged("find_nonfinite", case, run)


def run_trace(case: Case) -> Outcome:
    def run():
        graph = fg.trace(case.fn(), *case.args)
        out = case.fn()(*case.args)
        want = [tuple(np.shape(x)) for x in jax.tree.leaves(case.args)]
        got = [tuple(leaf.shape) for leaf in graph.leaves]
        if got != want:
            return f"leaf shapes {got} != the arguments' {want}"
        if len(graph.outputs) != len(jax.tree.leaves(out)):
            return f"{len(graph.outputs)} outputs, expected {len(jax.tree.leaves(out))}"
        str(graph)
        graph.to_dot()
        return None
    return judged("trace", case, run)


def run_memory_report(case: Case) -> Outcome:
    grad = case.out == "scalar" or (case.out == "aux" and case.plant)

    def run():
        report = fg.memory_report(case.fn(), *case.args, grad=grad, argnums=case.argnums)
        if report.temp_bytes < 0 or report.output_bytes < 0:
            return f"negative sizes: {report}"
        if grad:
            want = sum(jnp.asarray(g).nbytes for g in float_grads(case.fn(), case).values())
            if report.output_bytes < want:
                return f"output {report.output_bytes} B < the gradient's {want} B"
        str(report)
        return None
    return judged("memory_report", case, run)


def run_remat(case: Case) -> Outcome:
    def run():
        fn = case.fn()
        try:
            wrapped = fg.remat(fn)
            got = wrapped(*case.args)
        except Exception as error:  # the same call under jax.checkpoint: the same error?
            try:
                jax.checkpoint(fn)(*case.args)
            except type(error):
                return AS_JAX + f"jax.checkpoint: {type(error).__name__}"
            raise
        if not tree_close(got, fn(*case.args), rtol=case_rtol(case)):
            return "value differs from fn's"
        if _scalar_out(case):
            mine = float_grads(wrapped, case)
            flat = jax.tree.leaves(case.args)
            for j, g in float_grads(fn, case).items():
                if not close(mine[j], g, rtol=rtol_of(flat[j])):
                    return f"gradient of flat leaf {j}: {mine[j]} != jax.grad's {g}"
        return None
    return judged("remat", case, run)


def run_taps(case: Case) -> Outcome:
    def run():
        (value, grads, taps) = fg.intermediate_grads(case.fn(), case.argnums,
                                                     has_aux=case.has_aux)(*case.args)
        if not _scalar_out(case) or case.tap == "int":
            return f"accepted out={case.out} tap={case.tap}"
        loss = value[0] if case.has_aux else value
        if not close(loss, _value(case), rtol=case_rtol(case)):
            return f"value {loss} != {_value(case)}"
        if case.plant:
            return None
        bad = _arg_grads_ok(case, grads, float_grads(case.fn(), case))
        if bad:
            return bad
        if case.tap == "v":
            # dL/dv of L = sum(v**2) / 2 is v itself (v computed without the tap); of the
            # constant output, 0.
            v = _v_of(case) if case.out != "const" else jnp.zeros_like(_v_of(case))
            if not close(taps["h"], v, rtol=case_rtol(case)):
                return f"tap gradient {taps['h']} != v = {v}"
        elif taps:
            return f"taps {list(taps)} without a tap"
        return None
    return judged("intermediate_grads", case, run)


def _v_of(case: Case):
    return make_fn(dataclasses.replace(case, out="aux", tap=""))(*case.args)[1]["v"]


def run_backward(case: Case) -> Outcome:
    def run():
        fn = case.fn()
        out = fn(*case.args)
        out = out[0] if case.has_aux else out
        ct = (jnp.full(np.shape(out), 0.5, jnp.result_type(out))
              if isinstance(out, jax.Array) and out.ndim else None)
        grads = fg.backward(fn, *case.args, cotangent=ct, argnums=case.argnums,
                            has_aux=case.has_aux)
        if case.out in ("int", "pair_no_aux"):  # (a Python float constant has gradient 0)
            return f"accepted out={case.out}"
        if case.has_aux:
            grads = grads[0]
        if case.plant:
            return None
        scale = 1.0 if ct is None else 0.5
        oracle = float_grads(fn, case, loss_of=lambda o: scale * jnp.sum(
            o[0] if case.has_aux else o))
        return _arg_grads_ok(case, grads, oracle)
    return judged("backward", case, run)


TOOLS = {
    "check_grads": run_check_grads,
    "check_grads(directional)": run_directional,
    "audit": run_audit,
    "explain_grads": run_explain,
    "find_nonfinite": run_find_nonfinite,
    "trace": run_trace,
    "memory_report": run_memory_report,
    "remat": run_remat,
    "intermediate_grads": run_taps,
    "backward": run_backward,
}


# --- the interop adapters ----------------------------------------------------------------------

@st.composite
def interop_cases(draw) -> dict:
    """A small model of one library (a dense layer, optionally with a bias-free second layer),
    its parameter dtype, and an input batch: float32, bfloat16, empty (batch 0), an int array
    or a Python float."""
    return {"library": draw(st.sampled_from(["linen", "nnx", "equinox"])),
            "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
            "features": draw(st.integers(1, 3)), "two": draw(st.booleans()),
            "x": draw(st.sampled_from(["f32", "f32", "bf16", "empty", "int", "py_float"])),
            "batch": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 3))}


def _interop_model(c: dict):
    """(the adapter's Model, the library's own forward function of (params, x), the library's
    own object called on x)."""
    from funcgrad.interop import from_equinox, from_linen, from_nnx

    dtype, key = jnp.dtype(c["dtype"]), jax.random.key(c["seed"])
    if c["library"] == "linen":
        import flax.linen as nn

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                h = nn.Dense(c["features"], param_dtype=dtype, dtype=dtype)(x)
                return nn.Dense(2, use_bias=False, param_dtype=dtype)(h) if c["two"] else h

        module = Net()
        variables = module.init(key, jnp.ones((1, 3)))
        own = lambda p, x: module.apply({"params": p}, x)
        return from_linen(module, variables), own, lambda x: own(variables["params"], x)
    if c["library"] == "nnx":
        from flax import nnx

        layer = nnx.Linear(3, c["features"], param_dtype=dtype, dtype=dtype,
                           rngs=nnx.Rngs(c["seed"]))
        # nnx.Linear by hand: inputs and params cast to `dtype`, then x @ kernel + bias.
        return from_nnx(layer), lambda p, x: (jnp.asarray(x, dtype) @ p["kernel"].astype(dtype)
                                              + p["bias"].astype(dtype)[None, :]), layer
    import equinox as eqx

    layer = eqx.nn.Linear(3, c["features"], key=key, dtype=dtype)
    m = from_equinox(layer)
    own = lambda p, x: jax.vmap(eqx.combine(p, eqx.filter(layer, eqx.is_inexact_array,
                                                        inverse=True)))(x)
    return m, own, jax.vmap(layer)


def _interop_input(c: dict):
    rng = np.random.default_rng(c["seed"])
    x = rng.standard_normal((c["batch"], 3)).astype(np.float32)
    return {"f32": jnp.asarray(x), "bf16": jnp.asarray(x, jnp.bfloat16),
            "empty": jnp.zeros((0, 3), jnp.float32), "int": jnp.asarray(x > 0, jnp.int32),
            "py_float": 0.5}[c["x"]]


def run_interop(c: dict) -> Outcome:
    """The adapter's apply and its gradient against the library's own forward pass and
    jax.grad of it; a wrong input kind must get a clear error."""
    case = Case((), 0, "scalar", [])

    def run():
        m, own, library = _interop_model(c)
        x = _interop_input(c)
        try:
            out, _ = m.apply(m.params, m.model_state, x)
        except Exception as error:  # the library's own call on the same input: the same error?
            try:
                library(x)
            except type(error):
                return AS_JAX + f"the library's own call: {type(error).__name__}"
            raise
        want = own(m.params, x)
        rtol = 3e-2 if "bfloat16" in (c["dtype"], str(getattr(x, "dtype", ""))) else 1e-5
        if not tree_close(out, want, rtol=rtol, atol=1e-2 if rtol > 1e-5 else 1e-6):
            return f"apply {out} != the library's {want}"
        loss = lambda p: jnp.sum(jnp.square(m.apply(p, m.model_state, x)[0]).astype(jnp.float32))
        grads = jax.grad(loss)(m.params)
        want_g = jax.grad(lambda p: jnp.sum(jnp.square(own(p, x)).astype(jnp.float32)))(m.params)
        if not tree_close(grads, want_g, rtol=rtol, atol=1e-2 if rtol > 1e-5 else 1e-6):
            return "gradient differs from jax.grad of the library's own call"
        report = fg.check_grads(loss, m.params)
        return None if report.ok else f"check_grads failed a correct model:\n{report}"
    return judged("interop", case, run)
