"""The memory of the compiled train step (`funcgrad.memory_report`): XLA's argument, output
and temporary bytes and the estimated peak, on one batch of the run's shape."""
from __future__ import annotations

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding

NAME = "memory"


def check(ctx: Context) -> Finding:
    from funcgrad.memory.report import memory_report

    step, state = ctx.subject.make_step()
    batch = ctx.subject.step_batch(ctx.subject.data.train_batches())
    report = memory_report(step, state, batch)
    data = report.to_dict()
    peak = report.peak_bytes
    return Finding(NAME, "pass", f"compiled train step, estimated peak {_mib(peak)}: "
                   f"{report.dominant}", data)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
