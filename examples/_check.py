"""Shared by the examples: print a value next to its reference and remember any mismatch."""
import sys


class Check:
    """Collects rows ``name  value  reference  ok|MISMATCH``; `done()` exits 1 on a mismatch."""

    def __init__(self, title: str, left: str = "funcgrad", right: str = "by hand"):
        self.failed = 0
        print(f"{title}\n  {'':<36}{left:>14} {right:>14}")

    def row(self, name: str, value: float, reference: float, *, tol: float = 0.0) -> None:
        ok = abs(float(value) - float(reference)) <= tol
        self.failed += not ok
        print(f"  {name:<36}{float(value):>14.6g} {float(reference):>14.6g}   "
              f"{'ok' if ok else 'MISMATCH'}")

    def below(self, name: str, value: float, limit: float) -> None:
        """A row that passes when ``value <= limit`` (e.g. a max abs difference and its bound)."""
        ok = float(value) <= limit
        self.failed += not ok
        print(f"  {name:<36}{float(value):>14.6g} {limit:>14.6g}   {'ok' if ok else 'MISMATCH'}")

    def same(self, name: str, value: object, reference: object) -> None:
        """A row that passes when ``value == reference`` (strings, statuses, counts)."""
        ok = value == reference
        self.failed += not ok
        v, r = str(value), str(reference)
        w = max(14, len(v), len(r))  # long names widen their own row rather than run together
        print(f"  {name:<36}{v:>{w}} {r:>{w}}   {'ok' if ok else 'MISMATCH'}")

    def done(self) -> None:
        if self.failed:
            print(f"{self.failed} value(s) disagree with their reference", file=sys.stderr)
            sys.exit(1)
        print("all values agree")
