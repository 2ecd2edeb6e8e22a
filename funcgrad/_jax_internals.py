"""The one place that knows JAX's internals (private).

funcgrad reads what JAX does not promise to keep: the parameters of jaxpr equations (a scan's
body and how many of its inputs are consts and carries, a cond's branches, a custom rule's
thunks), the names of primitives, and the compiled program's memory analysis. These change
between releases; JAX 0.12, for one, dropped ``ClosedJaxpr`` (a ``Jaxpr`` now carries its
consts), gives every higher-order primitive an open ``Jaxpr``, and describes a scan's inputs by
a flat tree (``ft_in``) instead of ``num_consts``/``num_carry``. Every read of that kind goes
through an accessor here, each tested on every JAX in the tested range
(``tests/test_jax_internals.py``); an accessor that cannot find what it needs raises
`JaxInternalsError` naming the JAX version, the primitive and the tested range
(``funcgrad._jax_version``), never a ``KeyError`` from deep inside a tool.

What the tools read directly, as public structure of ``jax.extend.core``: an equation's
``invars``/``outvars``/``source_info``, a variable's ``aval``, and `is_literal`/`is_dropvar`.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from funcgrad._jax_version import jax_version, tested_range


class JaxInternalsError(RuntimeError):
    """funcgrad could not read a JAX internal it relies on (a jaxpr parameter, a custom rule's
    fields, the compiled program's memory analysis) in the installed JAX. Raised instead of a
    ``KeyError``/``AttributeError`` from inside a tool; the message names the JAX version,
    the primitive and the tested range."""


def _error(what: str, eqn: Any = None) -> JaxInternalsError:
    where = f" of primitive {eqn.primitive.name!r}" if eqn is not None else ""
    return JaxInternalsError(
        f"funcgrad could not read {what}{where} in jax {jax_version()} (tested on jax "
        f"{tested_range()}). This is funcgrad's problem, not your program's: please report "
        "it with this message, or install a tested JAX.")


# --- jaxpr structure --------------------------------------------------------------------------

def is_literal(v: Any) -> bool:
    """Whether a jaxpr atom is a literal (a constant written into the equation)."""
    from jax.extend import core
    return isinstance(v, core.Literal)


def is_dropvar(v: Any) -> bool:
    """Whether an equation's output variable is one nothing reads (``_``)."""
    from jax.extend import core
    return isinstance(v, core.DropVar)


def is_jaxpr(v: Any) -> bool:
    """Whether a parameter value is a jaxpr (open or closed, any release)."""
    from jax.extend import core
    return isinstance(v, (core.Jaxpr, core.ClosedJaxpr))


def closed_parts(sub: Any) -> tuple[Any, tuple]:
    """``(jaxpr, consts)`` of a jaxpr-valued parameter: a ClosedJaxpr (JAX <= 0.11), a Jaxpr
    that carries its consts (0.12), or an open Jaxpr with none. ``jaxpr.constvars`` pair with
    the consts, ``jaxpr.invars`` with the equation's inputs."""
    from jax.extend import core
    if isinstance(sub, core.ClosedJaxpr):  # in 0.12 the same class as Jaxpr: .jaxpr is itself
        return sub.jaxpr, tuple(sub.consts)
    if isinstance(sub, core.Jaxpr):
        return sub, tuple(getattr(sub, "consts", ()))
    raise _error(f"a jaxpr (got a {type(sub).__name__})")


def as_fun(jaxpr: Any, consts: Any = ()) -> Any:
    """A Python function evaluating `jaxpr` with `consts` on its inputs (JAX's evaluator:
    each equation replayed under its own source line)."""
    from jax.extend import core
    return core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, list(consts)))


def attach_consts(jaxpr: Any, consts: Any) -> tuple[Any, tuple]:
    """``(jaxpr, consts)`` as a rule's thunk returns them (a custom_vjp's fwd, a custom_jvp's
    jvp), made so that ``jaxpr.constvars`` pair with the consts and ``jaxpr.invars`` with the
    inputs. In JAX 0.12 a Jaxpr's constvars are the inputs it has values attached for, so the
    consts are attached; before, the open jaxpr's constvars already pair with them."""
    from jax.extend import core
    consts = tuple(consts)
    if not core_unified():  # JAX <= 0.11
        if len(jaxpr.constvars) != len(consts):
            raise _error(f"a rule's jaxpr with {len(jaxpr.constvars)} constvars for "
                         f"{len(consts)} consts")
        return jaxpr, consts
    if not consts:
        return closed_parts(jaxpr)
    if tuple(getattr(jaxpr, "consts", ())):
        raise _error("a rule's jaxpr that carries consts and was given more")
    return closed_parts(core.ClosedJaxpr(jaxpr, list(consts)))


def name(eqn: Any) -> str:
    """The primitive's name as JAX spells it (``"pjit"``, ``"remat2"``, ``"tanh"``)."""
    return eqn.primitive.name


#: Several names for one kind of primitive across releases.
_KINDS = {
    "pjit": "jit", "jit": "jit", "closed_call": "call", "core_call": "call",
    "remat2": "checkpoint", "checkpoint": "checkpoint", "remat": "checkpoint",
    "custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp",
    "custom_vjp_call_jaxpr": "custom_vjp",
}


def kind(eqn: Any) -> str:
    """The primitive's kind, one name across releases: ``"jit"`` (pjit, jit), ``"call"``
    (closed_call, core_call), ``"checkpoint"`` (remat2, checkpoint, remat), ``"custom_jvp"``,
    ``"custom_vjp"``; every other primitive by its own name (``"scan"``, ``"cond"``,
    ``"while"``, ``"tanh"``)."""
    return _KINDS.get(eqn.primitive.name, eqn.primitive.name)


#: Kinds whose body runs once on the equation's inputs (the last ``len(body.invars)`` of them).
CALL_KINDS = frozenset({"jit", "call", "checkpoint"})
CUSTOM_KINDS = frozenset({"custom_jvp", "custom_vjp"})


def param(eqn: Any, key: str, default: Any = ...) -> Any:
    """``eqn.params[key]``; without a `default`, a missing key is a `JaxInternalsError`."""
    if key in eqn.params:
        return eqn.params[key]
    if default is ...:
        raise _error(f"the parameter {key!r}", eqn)
    return default


class Params:
    """An equation's parameters, read through `param`: ``p["dimension_numbers"]`` raises
    `JaxInternalsError` when this JAX has no such parameter; ``p.get(key, default)`` does not."""

    __slots__ = ("_eqn",)

    def __init__(self, eqn: Any):
        self._eqn = eqn

    def __getitem__(self, key: str) -> Any:
        return param(self._eqn, key)

    def __contains__(self, key: str) -> bool:
        return key in self._eqn.params

    def get(self, key: str, default: Any = None) -> Any:
        return self._eqn.params.get(key, default)


def params(eqn: Any) -> Params:
    """`Params` of `eqn`."""
    return Params(eqn)


def function_name(eqn: Any) -> str | None:
    """The user's function a call, jit or custom rule wraps (``"norm"``), if JAX recorded it."""
    found = eqn.params.get("name")
    if found:
        return str(found)
    for key in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
        if key in eqn.params and is_jaxpr(eqn.params[key]):
            info = getattr(closed_parts(eqn.params[key])[0], "debug_info", None)
            found = getattr(info, "func_name", None)
            if found:
                return str(found)
    return None


def body(eqn: Any) -> tuple[Any, tuple] | None:
    """``(jaxpr, consts)`` a call-like equation runs on the last ``len(jaxpr.invars)`` of its
    inputs: jit, call, checkpoint, and the primal program of a custom_jvp/custom_vjp
    function. None for every other kind."""
    k = kind(eqn)
    if k in CALL_KINDS:
        key = "call_jaxpr" if k == "call" else "jaxpr"
    elif k in CUSTOM_KINDS:
        key = "fun_jaxpr" if eqn.primitive.name == "custom_vjp_call_jaxpr" else "call_jaxpr"
    else:
        return None
    return closed_parts(param(eqn, key))


def call_body(eqn: Any) -> tuple[Any, tuple]:
    """`body` of an equation its caller has found call-like (a kind in `CALL_KINDS` or
    `CUSTOM_KINDS`); any other equation is a ValueError."""
    found = body(eqn)
    if found is None:
        raise ValueError(f"{name(eqn)} is not a call-like equation (jit, call, checkpoint, "
                         "custom_jvp, custom_vjp): it has no body")
    return found


def sub_jaxprs(eqn: Any) -> Iterator[tuple[str, Any, tuple]]:
    """The jaxprs nested in `eqn`'s parameters as ``(param name, jaxpr, consts)``; a
    tuple-valued parameter (cond's ``branches``) yields ``branches[i]`` per element."""
    for key, value in eqn.params.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for i, v in enumerate(values):
            if is_jaxpr(v):
                jaxpr, consts = closed_parts(v)
                yield (f"{key}[{i}]" if isinstance(value, (tuple, list)) else key), jaxpr, consts


class Scan(NamedTuple):
    """A scan equation's parts: its inputs are ``consts + carry + xs`` (num_consts, num_carry
    and the rest), its body's outputs ``carry + ys``."""
    body: Any          # the body's Jaxpr
    body_consts: tuple
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan(eqn: Any) -> Scan:
    """`Scan` of a ``scan`` equation: ``num_consts``/``num_carry`` (JAX <= 0.11), or the
    lengths of the groups of its flat tree ``ft_in`` (0.12: ``(consts, carry, xs)``)."""
    p = eqn.params
    jaxpr, consts = closed_parts(param(eqn, "jaxpr"))
    if "num_consts" in p and "num_carry" in p:
        nc, nk = p["num_consts"], p["num_carry"]
    elif "ft_in" in p:
        try:
            groups = p["ft_in"].unpack()
            nc, nk = len(groups[0]), len(groups[1])
        except Exception as error:  # noqa: BLE001 - reported as ours, with the cause
            raise _error(f"the consts/carry split of ft_in ({error})", eqn) from error
        if len(groups) != 3 or sum(len(g) for g in groups) != len(eqn.invars):
            raise _error(f"the consts/carry/xs groups of ft_in ({p['ft_in']!r})", eqn)
    else:
        raise _error("the number of consts and carries (neither num_consts nor ft_in)", eqn)
    return Scan(jaxpr, consts, int(nc), int(nk), int(param(eqn, "length")),
                bool(param(eqn, "reverse")), p.get("unroll", 1))


def cond_branches(eqn: Any) -> list[tuple[Any, tuple]]:
    """``[(jaxpr, consts), ...]`` of a ``cond`` equation, in index order (its first input is
    the index, the rest the branches' operands)."""
    return [closed_parts(b) for b in param(eqn, "branches")]


class While(NamedTuple):
    """A while_loop equation's parts: its inputs are ``cond consts + body consts + carry``."""
    cond: Any
    cond_consts: tuple
    body: Any
    body_consts: tuple
    cond_nconsts: int
    body_nconsts: int


def while_loop(eqn: Any) -> While:
    """`While` of a ``while`` equation."""
    cond, cond_consts = closed_parts(param(eqn, "cond_jaxpr"))
    body_, body_consts = closed_parts(param(eqn, "body_jaxpr"))
    return While(cond, cond_consts, body_, body_consts, int(param(eqn, "cond_nconsts")),
                 int(param(eqn, "body_nconsts")))


class CustomJVP(NamedTuple):
    """A custom_jvp_call's rule: its first `num_consts` inputs are closed-over values;
    ``jvp_jaxpr_fun.call_wrapped(*zeros)`` (one bool per other input: its tangent is a
    symbolic zero) gives ``(jvp jaxpr, consts, which outputs' tangents are zero)``."""
    num_consts: int
    jvp_jaxpr_fun: Any
    symbolic_zeros: bool


def custom_jvp(eqn: Any) -> CustomJVP:
    return CustomJVP(int(param(eqn, "num_consts")), param(eqn, "jvp_jaxpr_fun"),
                     bool(eqn.params.get("symbolic_zeros", False)))


class CustomVJP(NamedTuple):
    """A custom_vjp_call's rule. ``fwd_jaxpr_thunk.call_wrapped(*floats)`` gives ``(fwd
    jaxpr, consts)`` whose outputs are the residuals not forwarded from inputs, then the
    primal outputs; ``out_trees()`` gives ``(out tree, residual tree, forwards)`` (forwards:
    per residual, the input index it is, or None); ``bwd.call_wrapped(*res, *cts)`` the
    inputs' cotangents (JAX's symbolic zeros where the user returned None)."""
    num_consts: int
    fwd_jaxpr_thunk: Any
    bwd: Any
    out_trees: Any
    symbolic_zeros: bool

    def user_bwd(self) -> Any:
        """The user's own bwd function, unwrapped from JAX's flattening where JAX keeps it."""
        return getattr(self.bwd, "f", self.bwd)

    def call_bwd(self, n_inputs: int, *res_and_cts: Any) -> list:
        """The inputs' cotangents from the flattened bwd at ``residuals + output
        cotangents``: a list of `n_inputs` (JAX 0.12 returns ``(cotangents, logs)``)."""
        out = self.bwd.call_wrapped(*res_and_cts)
        if (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple))
                and len(out[0]) == n_inputs):
            out = out[0]
        out = list(out)
        if len(out) != n_inputs:
            raise _error(f"custom_vjp's bwd output ({len(out)} cotangents for {n_inputs} "
                         "inputs)")
        return out

    def residual_layout(self) -> tuple[int, list]:
        """``(number of residuals fwd returns, forwards)``."""
        trees = self.out_trees()
        if not (isinstance(trees, tuple) and len(trees) == 3):
            raise _error(f"custom_vjp's out_trees() (got {type(trees).__name__})")
        _, res_tree, forwards = trees
        forwards = list(forwards)
        return res_tree.num_leaves - sum(f is not None for f in forwards), forwards


def custom_vjp(eqn: Any) -> CustomVJP:
    return CustomVJP(int(param(eqn, "num_consts")), param(eqn, "fwd_jaxpr_thunk"),
                     param(eqn, "bwd"), param(eqn, "out_trees"),
                     bool(eqn.params.get("symbolic_zeros", False)))


class Checkpoint(NamedTuple):
    """A checkpoint (remat) equation's parts."""
    body: Any
    body_consts: tuple
    policy: Any         # None: save nothing but the inputs
    prevent_cse: bool


def checkpoint(eqn: Any) -> Checkpoint:
    jaxpr, consts = closed_parts(param(eqn, "jaxpr"))
    return Checkpoint(jaxpr, consts, eqn.params.get("policy"),
                      bool(eqn.params.get("prevent_cse", True)))


def policy_name(policy: Any) -> str:
    """A checkpoint policy as a user wrote it: ``dots_saveable``,
    ``save_only_these_names('act')``. JAX 0.10 policies are objects with a repr of their own
    (``SaveOnlyTheseNames(saveable_names=frozenset({'act'}))``, kept as is); 0.12's are plain
    functions, the factory's closure, whose repr is only an address."""
    qualname = getattr(policy, "__qualname__", None)  # a function's; an instance has none
    if not qualname:
        return repr(policy)
    base, local, _ = qualname.partition(".<locals>")
    if not local:
        return qualname
    args = []
    for cell in getattr(policy, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, (set, frozenset)):
            args += [repr(v) for v in sorted(value, key=str)]
        elif isinstance(value, str):
            args.append(repr(value))
    return f"{base}({', '.join(args)})"


def policy_saved_names(policy: Any) -> set[str] | None:
    """The names a ``save_only_these_names``-style policy saves (``save_and_offload_only_these
    _names`` too), or None for a policy that saves by another rule. JAX 0.10's policies keep
    them as fields, 0.12's in the factory's closure."""
    if policy is None:
        return None
    for field in ("saveable_names", "names_which_can_be_saved"):
        found = getattr(policy, field, None)
        if found is not None:
            return {str(n) for n in found}
    qualname = getattr(policy, "__qualname__", "") or ""
    if "these_names" not in qualname:
        return None
    names: set[str] = set()
    for cell in getattr(policy, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, (set, frozenset, tuple, list)) and all(
                isinstance(v, str) for v in value):
            names |= set(value)
    return names


def bind(eqn: Any, ins: list) -> list:
    """Applies `eqn`'s primitive to the values `ins` as JAX would; always a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)  # higher-order ones need subfuns
    subfuns, params = bind_params if isinstance(bind_params, tuple) else ([], bind_params)
    outs = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def bind_with(eqn: Any, ins: list, **changed: Any) -> list:
    """`bind` with some parameters replaced (a dtype widened, a combiner jaxpr lifted)."""
    return bind(eqn.replace(params={**eqn.params, **changed}), ins)


def scatter_combiner(eqn: Any, lifted: Any) -> dict:
    """The parameters that give a scatter equation the combiner `lifted` (a closed jaxpr of
    two scalars): ``update_jaxpr`` (an open jaxpr) and ``update_consts``."""
    param(eqn, "update_jaxpr")
    jaxpr, consts = closed_parts(lifted)
    if consts and "update_consts" not in eqn.params:
        raise _error("the parameter 'update_consts'", eqn)
    if consts and core_unified():  # JAX 0.12 combiners have none; a lifted one has none either
        raise _error("a scatter combiner with consts", eqn)
    return {"update_jaxpr": jaxpr, "update_consts": tuple(consts)}


def core_unified() -> bool:
    """Whether this JAX has one Jaxpr class carrying its consts (0.12) rather than a
    ClosedJaxpr around an open Jaxpr (0.10, 0.11)."""
    from jax.extend import core
    return core.ClosedJaxpr is core.Jaxpr


def source_summary(eqn: Any) -> str:
    """JAX's one-line summary of where `eqn` was made (``/path/file.py:12:4 (fn)``), or ""."""
    from jax.extend import source_info_util
    try:
        return source_info_util.summarize(eqn.source_info) or ""
    except Exception:  # noqa: BLE001 - source info is best effort
        return ""


def in_transpose(eqn: Any) -> bool:
    """Whether JAX made `eqn` by transposing (its name stack reads ``transpose(jvp(...))``)."""
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return any(type(e).__name__ == "Transform" and getattr(e, "name", None) == "transpose"
               for e in stack)


# --- autodiff internals -----------------------------------------------------------------------

def saved_residuals(fn: Any, *args: Any) -> list:
    """``jax.ad_checkpoint.saved_residuals``-style list of ``(aval, description)`` of what
    `fn`'s vjp keeps at `args` (JAX's private ``saved_residuals``, no public name)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals as found
    except ImportError as error:
        raise _error("jax._src.ad_checkpoint.saved_residuals (pass residuals=False to do "
                     "without the residual list)") from error
    return found(fn, *args)


def tracer_types() -> tuple[type, ...]:
    """The JVP and batching tracer classes (no public API names them)."""
    try:
        from jax._src.interpreters import ad, batching
        found = (ad.JVPTracer, batching.BatchTracer)
    except (ImportError, AttributeError) as error:
        raise _error("the JVP and batching tracer classes (jax._src.interpreters.ad."
                     "JVPTracer, batching.BatchTracer)") from error
    return found


# --- compiled programs ------------------------------------------------------------------------

class MemoryStats(NamedTuple):
    """Bytes of a compiled program's buffers (XLA's ``memory_analysis()``)."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int


def memory_stats(compiled: Any) -> MemoryStats | None:
    """`MemoryStats` of a ``jax.stages.Compiled``; None where the backend gives no analysis.

    Raises `JaxInternalsError` when the analysis exists but lacks a field funcgrad reads."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    try:
        return MemoryStats(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                           int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes),
                           int(getattr(stats, "generated_code_size_in_bytes", 0)))
    except AttributeError as error:
        raise _error(f"a field of compiled.memory_analysis() ({error})") from error


def compiled_text(compiled: Any) -> str:
    """The compiled program's HLO text (``as_text()``), "" where the backend gives none."""
    try:
        return compiled.as_text() or ""
    except Exception:  # noqa: BLE001 - only used to count fusions, best effort
        return ""


def frames(eqn: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of every frame where `eqn` was made, innermost first (JAX's
    own frames included); [] when JAX kept no traceback."""
    try:
        tb = eqn.source_info.traceback
        return [(f.file_name, int(f.line_num), f.function_name) for f in tb.frames]
    except Exception:  # noqa: BLE001 - source info is best effort
        return []
