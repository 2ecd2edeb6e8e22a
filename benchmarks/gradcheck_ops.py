"""funcgrad.check_grads judged on an op table built from JAX's autodiff test specs.

For each op of tests/check/_op_table.py (135 configurations modelled on JAX's lax_autodiff_test,
lax_numpy_test grad table, linalg, nn and control-flow grad checks, at JAX's input ranges),
in float64 and float32 (the op computes in that dtype), in full and directional mode:

  * the unmodified op checked in full mode (rev + fwd), and JAX's own gradient through a
    custom_vjp (delta 0) in both modes: a report that is not ok is a false failure;
  * one element of one input's gradient (the largest |gradient|) scaled by 1 + delta,
    delta in {1e-2, 1e-4}: caught, or missed while the error exceeds what the report states
    it can see (full: e > resolution + rtol*|g|; directional: e > resolution), and in full
    mode whether `worst_index` names the planted element; `jax.test_util.check_grads`
    (order 1, rev) on the same planted bugs for comparison;
  * with --order2, the unmodified ops JAX checks at order 2, at order 2 (full mode);
  * flax.linen models (Dense -> Conv -> LayerNorm, float32 and bfloat16 compute) with a bug
    planted in a custom_vjp activation.

Until `LeafCheck.resolution` exists the resolution is today's fallback (tests/check/_op_judge.py).

    $ python benchmarks/gradcheck_ops.py [--ops SUBSTRING] [--order2] [--no-flax]
                                         [--out benchmarks/results/gradcheck_ops.json]
"""
import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests",
                                "check"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _op_judge as judge  # noqa: E402
import _op_table as table  # noqa: E402
from _flax_cases import flax_cases  # noqa: E402
from _timing import write_results  # noqa: E402

DELTAS = (1e-2, 1e-4)


def _fraction(rows, key):
    return f"{sum(r[key] for r in rows)}/{len(rows)}" if rows else "-"


def summarise(verdicts):
    """Rows of the summary table: per dtype x mode, false failures and caught fractions."""
    out = []
    groups = collections.defaultdict(list)
    for v in verdicts:
        groups[(v["dtype"], v["mode"])].append(v)
    for (dtype, mode), vs in sorted(groups.items()):
        correct = [v for v in vs if v.get("delta", 0) == 0]
        false = [v for v in correct if not v.get("ok", not v.get("caught"))
                 or v.get("other_leaves_failed")]
        row = {"dtype": dtype, "mode": mode, "correct_checks": len(correct),
               "false_failures": len(false)}
        for d in DELTAS:
            planted = [v for v in vs if v.get("delta") == d]
            must = [v for v in planted if v["must_catch"]]
            row[f"caught_{d:g}"] = _fraction(planted, "caught")
            row[f"must_catch_caught_{d:g}"] = _fraction(must, "caught")
            row[f"jax_caught_{d:g}"] = _fraction([v for v in planted if "jax_caught" in v],
                                                 "jax_caught")
            # full mode must name the planted element; directional bisects to one (reported)
            row[f"worst_wrong_{d:g}"] = sum(v["caught"] and not v["worst_ok"] for v in planted)
        planted = [v for v in vs if v.get("delta")]
        if planted:
            rel = [v["resolution"] / abs(v["grad"]) for v in planted]
            row["resolution_over_|g|_median"] = statistics.median(rel)
            row["resolution_source"] = sorted({v["resolution_source"] for v in planted})
        out.append(row)
    return out


def markdown(summary, jax_version) -> str:
    """The table of docs/guide/check.md ("Measured"): per dtype and mode, false failures and
    caught fractions."""
    def frac(row, key):
        return row.get(key) or "-"
    lines = [f"jax {jax_version}:", "",
             "| dtype the op computes in | mode | false failures | 1e-2 caught | 1e-4 caught "
             "| jax.test_util.check_grads 1e-2 / 1e-4 |", "|---|---|---|---|---|---|"]
    for r in sorted(summary, key=lambda r: (r["dtype"] != "float64", r["mode"])):
        dtype = r["dtype"] + (" (lifted)" if r["dtype"] != "float64" else "")
        caught = [f"{frac(r, f'caught_{d:g}')} ({frac(r, f'must_catch_caught_{d:g}')} above "
                  "the stated resolution)" for d in DELTAS]
        jax_ = (f"{frac(r, 'jax_caught_0.01')} / {frac(r, 'jax_caught_0.0001')}"
                if r["mode"] == "full" else "")
        lines.append(f"| {dtype} | {r['mode']} | {r['false_failures']} of "
                     f"{r['correct_checks']} | {caught[0]} | {caught[1]} | {jax_} |")
    return "\n".join(lines)


def merge(paths, out) -> None:
    """Summary of several shards' results (same JAX), printed and written to `out`."""
    import json
    parts = [json.load(open(p)) for p in paths]
    versions = {p["jax"] for p in parts}
    if len(versions) != 1:
        raise SystemExit(f"--merge: the shards ran on different JAX versions {versions}")
    verdicts = [v for p in parts for v in p["rows"]]
    summary = summarise([v for v in verdicts if v.get("order", 1) == 1])
    problems = [line for p in parts for line in p["problems"]]
    print(markdown(summary, versions.pop()))
    print(f"{sum(p['ops'] for p in parts)} op configurations, "
          f"{max(p['seconds'] for p in parts):.0f} s (the slowest shard); "
          f"{len(problems)} problem(s)" + "".join(f"\n  {line}" for line in problems))
    write_results(out, verdicts, summary=summary, flax=parts[0]["flax"], problems=problems,
                  seconds=max(p["seconds"] for p in parts),
                  ops=sum(p["ops"] for p in parts), shards=list(paths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="only ops whose name contains this")
    parser.add_argument("--order2", action="store_true", help="also check order 2")
    parser.add_argument("--no-flax", action="store_true")
    parser.add_argument("--shard", default="0/1", help="i/k: every k-th op from the i-th")
    parser.add_argument("--out", default="benchmarks/results/gradcheck_ops.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine the results of shards (--shard i/k runs) into one "
                             "table, printed as Markdown and written to --out")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    i, k = (int(a) for a in args.shard.split("/"))
    ops = [op for op in table.OPS if args.ops in op.name][i::k]
    start = time.perf_counter()
    verdicts = []
    for i, op in enumerate(ops):
        for dtype in ("float64", "float32"):
            verdicts.append(judge.check_correct(op, dtype, "full"))
            if args.order2 and op.order == 2:
                verdicts.append(judge.check_correct(op, dtype, "full", order=2))
            for mode in ("full", "directional"):
                verdicts += judge.check_planted(op, dtype, mode, (0.0, *DELTAS),
                                                with_jax=mode == "full")
        print(f"\r{i + 1}/{len(ops)} ops, {time.perf_counter() - start:.0f} s", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for v in verdicts:  # jax's verdict is per planted bug, not per mode: copy it over
        if v.get("delta") and v["mode"] == "directional":
            twin = next(w for w in verdicts if w.get("delta") == v["delta"] and w["mode"] == "full"
                        and w["op"] == v["op"] and w["dtype"] == v["dtype"])
            v["jax_caught"] = twin.get("jax_caught")
    seconds = time.perf_counter() - start
    flax = [] if args.no_flax else flax_cases()
    summary = summarise([v for v in verdicts if v.get("order", 1) == 1])
    cols = ["dtype", "mode", "correct_checks", "false_failures"]
    for d in DELTAS:
        cols += [f"caught_{d:g}", f"must_catch_caught_{d:g}", f"jax_caught_{d:g}"]
    cols += ["worst_wrong_0.01", "worst_wrong_0.0001", "resolution_over_|g|_median"]
    print(f"{len(ops)} op configurations, {seconds:.0f} s")
    print("  ".join(cols))
    for r in summary:
        print("  ".join(f"{r.get(c, '-'):.2g}" if isinstance(r.get(c), float)
                        else str(r.get(c, "-")) for c in cols))
    print("resolution: " + "; ".join(f"{r['dtype']} {r['mode']}: {r.get('resolution_source')}"
                                     for r in summary))
    order2 = [v for v in verdicts if v.get("order") == 2]
    if order2:
        print(f"order 2 (unmodified ops, full): {sum(not v['ok'] for v in order2)} false "
              f"failures of {len(order2)}")
    for c in flax:
        print(f"flax {c['case']} [{c['mode']}]: planted {c['planted']}, max planted error "
              f"{c['error']:.3g}, resolution {c['resolution']:.3g} ({c['resolution_source']}), "
              f"dtype_used {c['dtype_used']}, lifted_from {c['lifted_from']}: "
              f"{'caught' if c['caught'] else 'passed'}"
              + ("" if c["caught"] or not c["must_catch"] else "  MISSED")
              + ("" if c["jax_caught"] is None else
                 f"; jax.test_util {'caught' if c['jax_caught'] else 'passed'}"))
    lines = judge.problems(verdicts)
    for c in flax:
        where = f"flax {c['case']} [{c['mode']}, delta {c['delta']:g}]"
        if c["caught"] and not c["delta"]:
            lines.append(f"{where} false failure: {c['statuses']}")
        elif not c["caught"] and (c["must_catch"] or c["required"]):
            lines.append(f"{where} missed: max error {c['error']:.3g}, resolution "
                         f"{c['resolution']:.3g} ({c['resolution_source']})"
                         + (" (issue 12 point 2 requires a fail)" if c["required"] else ""))
    print(f"{len(lines)} problem(s):")
    for line in lines:
        print("  " + line)
    write_results(args.out, verdicts, summary=summary, flax=flax, problems=lines,
                  seconds=seconds, ops=len(ops))


if __name__ == "__main__":
    main()
