"""Fuzz every public tool (tests/_fuzz_cases.py): each drawn call gives the answer derived
without funcgrad, or a clear error of funcgrad's own; never a crash inside funcgrad.

Budget: 2,002 calls without float16 (the examples per tool below, and 12 interop models), 90
more with it, derandomized so that every run draws the same cases. The larger run is
`python benchmarks/fuzz.py --examples 400`. Float16 cases are marked `float16`: XLA:CPU cannot
compile float16 conversions on a CPU without F16C ("Failed to materialize symbols"), and
tests/conftest.py skips them there.
"""
import collections

import _fuzz_cases as fz
import pytest
from hypothesis import HealthCheck, given, settings

# Examples per tool: the cheap tools get more (intermediate_grads ~25 ms a call, check_grads
# ~0.15 s, audit ~0.35 s on the shared 2-core machine).
EXAMPLES = {"check_grads": 40, "check_grads(directional)": 25, "audit": 25,
            "explain_grads": 40, "find_nonfinite": 200, "trace": 450, "memory_report": 150,
            "remat": 60, "intermediate_grads": 700, "backward": 300}
INTEROP_EXAMPLES = 12  # ~1 s a call: flax and equinox models, each checked by check_grads


def _fuzz(strategy, run, examples: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    problems: list[str] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case):
        outcome = run(case)
        counts[outcome.kind] += 1
        if outcome.kind in ("wrong", "crash"):
            described = case.describe() if isinstance(case, fz.Case) else case
            problems.append(f"{outcome.kind}: {described}\n  {outcome.detail}")

    one()
    assert not problems, "\n".join(problems[:10])
    return counts


@pytest.mark.parametrize("tool", list(EXAMPLES))
def test_every_call_is_right_or_a_clear_error(tool):
    counts = _fuzz(fz.cases(), fz.TOOLS[tool], EXAMPLES[tool])
    # Hypothesis stops early only when it has drawn every case it can; these spaces are far
    # larger. Some answers were checked, not only errors.
    assert sum(counts.values()) >= EXAMPLES[tool] // 2 and counts["right"] > 0, counts


def test_interop_adapters_agree_with_the_library_or_raise_clearly():
    counts = _fuzz(fz.interop_cases(), fz.run_interop, INTEROP_EXAMPLES)
    assert counts["right"] > 0, counts


@pytest.mark.float16
@pytest.mark.parametrize("tool", ["check_grads", "find_nonfinite", "trace", "remat",
                                  "intermediate_grads", "backward"])
def test_float16_leaves(tool):
    counts = _fuzz(fz.cases(float16=True), fz.TOOLS[tool], 15)
    assert counts["right"] > 0, counts
