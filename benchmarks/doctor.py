"""The doctor's scoreboard on the planted-fault suite (issue 26, point 4 and its targets).

Runs ``funcgrad.doctor.doctor_file`` on every model file of tests/doctor/models/ (each declares
``EXPECT``: the fault class, the checks any one of which flagging it counts as detection, and the
place localisation must name; ``EXPECT = None`` for a healthy model) and scores it:
  * detected: a check of ``EXPECT["checks"]`` says warn or fail;
  * localised: ``EXPECT["place"]`` (a leaf path, layer name or 'file.py:LINE' substring) is in
    the place or the summary of one of those flagging findings; faults whose place is None
    (a learning rate, a coupled loss) are left out of the localisation rate;
  * false alarm: a healthy model with any warn or fail (each one named);
  * a check that crashed ("error") is listed apart.
Prints one row per model, then per fault class (detected, localised) and the totals against the
targets (detection >= 95%, localisation >= 85%, false alarms 0), and writes JSON.

    $ python benchmarks/doctor.py [--only SUBSTRING] [--out benchmarks/results/doctor.json]
"""
import argparse
import ast
import pathlib
import sys
import time
import warnings

from _timing import write_results

from funcgrad.doctor import doctor_file

MODELS = pathlib.Path(__file__).resolve().parent.parent / "tests" / "doctor" / "models"
FLAGS = ("warn", "fail")
TARGETS = {"detection": 0.95, "localisation": 0.85, "false_alarms": 0}


def expect_of(path: pathlib.Path):
    """The file's ``EXPECT``, read without importing it (a literal: dict, set, str, None)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EXPECT" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path.name} declares no EXPECT")


def _text(finding) -> str:
    place = finding.place or {}
    return " ".join([*(str(v) for v in place.values()), finding.summary or ""])


def score(report, expect) -> dict:
    """Detection, localisation and false alarms of one report against its file's EXPECT."""
    flagged = [f for f in report.findings if f.verdict in FLAGS]
    row = {"flagged": [f"{f.check}:{f.verdict}" for f in flagged],
           "errors": [f"{f.check}: {f.summary}" for f in report.findings if f.verdict == "error"]}
    if expect is None:
        row["false_alarms"] = [f"{f.check} {f.verdict}: {f.summary}" for f in flagged]
        return row
    right = [f for f in flagged if f.check in expect["checks"]]
    row["detected"] = bool(right)
    place = expect["place"]
    row["localised"] = None if place is None else any(place in _text(f) for f in right)
    row["said"] = [f"{f.check} {f.verdict}: {f.summary} | place {f.place}" for f in right]
    return row


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="",
                        help="run only the files whose name contains one of these "
                             "(comma-separated)")
    parser.add_argument("--out", default="benchmarks/results/doctor.json")
    args = parser.parse_args()
    only = [o for o in args.only.split(",") if o] or [""]
    files = sorted(p for p in MODELS.glob("*.py")
                   if not p.name.startswith("_") and any(o in p.stem for o in only))
    rows = []
    print(f"{'model':32s} {'expected':24s} {'det':>4s} {'loc':>4s} {'time':>6s}  flagged")
    for path in files:
        expect = expect_of(path)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = doctor_file(path)
            row = score(report, expect)
        except Exception as e:  # a model the doctor cannot run at all is a miss, not a crash
            first = str(e).splitlines()[0] if str(e) else ""
            row = {"flagged": [], "raised": f"{type(e).__name__}: {first}",
                   "errors": [f"doctor_file raised {type(e).__name__}: {first}"]}
            row |= ({"false_alarms": []} if expect is None
                    else {"detected": False, "localised": None if expect["place"] is None
                          else False, "said": []})
        row |= {"model": path.stem, "fault": None if expect is None else expect["fault"],
                "checks": None if expect is None else sorted(expect["checks"]),
                "place": None if expect is None else expect["place"],
                "seconds": round(time.perf_counter() - start, 2)}
        rows.append(row)
        mark = lambda v: "-" if v is None else ("yes" if v else "NO")
        det = (mark(row.get("detected")) if expect else
               "ERR" if row.get("raised") else "ok" if not row["false_alarms"] else "FA")
        loc = mark(row.get("localised")) if expect else ""
        print(f"{path.stem:32s} {row['fault'] or 'healthy':24s} {det:>4s} {loc:>4s} "
              f"{row['seconds']:5.1f}s  {', '.join(row['flagged'])}", flush=True)

    faulty = [r for r in rows if r["fault"] is not None]
    healthy = [r for r in rows if r["fault"] is None]
    print(f"\n{'fault class':24s} {'models':>6s} {'detected':>14s} {'localised':>14s}")
    classes = sorted({r["fault"] for r in faulty})
    per_class = {}
    for c in classes:
        rs = [r for r in faulty if r["fault"] == c]
        placed = [r for r in rs if r["localised"] is not None]
        per_class[c] = {"models": len(rs), "detected": sum(r["detected"] for r in rs),
                        "localised": sum(bool(r["localised"]) for r in placed),
                        "with_place": len(placed)}
        pc = per_class[c]
        print(f"{c:24s} {len(rs):6d} {_pct(pc['detected'], len(rs)):>14s} "
              f"{_pct(pc['localised'], len(placed)):>14s}")
    detected = sum(r["detected"] for r in faulty)
    placed = [r for r in faulty if r["localised"] is not None]
    localised = sum(bool(r["localised"]) for r in placed)
    false_alarms = [(r["model"], a) for r in healthy for a in r["false_alarms"]]
    seconds = [r["seconds"] for r in rows]
    totals = {
        "faulty_models": len(faulty), "fault_classes": len(classes),
        "healthy_models": len(healthy),
        "detected": detected, "detection": detected / len(faulty) if faulty else None,
        "localised": localised, "with_place": len(placed),
        "localisation": localised / len(placed) if placed else None,
        "false_alarm_models": len({m for m, _ in false_alarms}),
        "false_alarms": len(false_alarms),
        "healthy_not_examined": sorted(r["model"] for r in healthy if r.get("raised")),
        "errors": sum(len(r["errors"]) for r in rows),
        "seconds_total": round(sum(seconds), 1),
        "seconds_median": round(sorted(seconds)[len(seconds) // 2], 1) if seconds else None,
        "seconds_max": max(seconds) if seconds else None,
    }
    print(f"\ndetection    {_pct(detected, len(faulty))}  (target >= 95%)")
    print(f"localisation {_pct(localised, len(placed))}  (target >= 85%; "
          f"{len(faulty) - len(placed)} faults have no place)")
    print(f"false alarms {len(false_alarms)} on {totals['false_alarm_models']} of "
          f"{len(healthy)} healthy models  (target 0)")
    if totals["healthy_not_examined"]:
        print(f"healthy models the doctor could not run (not counted as passing): "
              f"{', '.join(totals['healthy_not_examined'])}")
    print(f"time per model: median {totals['seconds_median']} s, max {totals['seconds_max']} s, "
          f"total {totals['seconds_total']} s")
    for r in faulty:
        if not r["detected"]:
            print(f"MISSED  {r['model']} ({r['fault']}, wanted {r['checks']}): "
                  f"flagged {r['flagged'] or 'nothing'}")
        elif r["localised"] is False:
            print(f"UNPLACED {r['model']} (wanted {r['place']!r}): {r['said']}")
    for model, alarm in false_alarms:
        print(f"FALSE ALARM {model}: {alarm}")
    for r in rows:
        for e in r["errors"]:
            print(f"ERROR {r['model']}: {e}")
    write_results(args.out, rows, totals=totals, per_class=per_class, targets=TARGETS,
                  command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]))


if __name__ == "__main__":
    main()
