"""The benchmark's table: one row per operation, each contender's median and the ratios."""

from __future__ import annotations

from typing import Any

from tools.bench.workload import CONTENDERS, GiB, MiB


# --------------------------------------------------------------------------- report
def _size(n: int) -> str:
    return f"{n // GiB}GiB" if n >= GiB and n % GiB == 0 else f"{n / MiB:g}MiB"


def _cell(summary: dict[str, Any]) -> str:
    status = summary.get("status")
    if status == "ok":
        return f"{summary['median_ms']:.3f}"
    return str(status)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


def _cmds(summary: dict[str, Any]) -> str:
    c = summary.get("commands")
    return str(sum(c.values())) if c else "-"


HEADER = (
    f"{'case':<14} {'op':<19} {'tdstore ms':>11} {'reference ms':>13} {'raw ms':>9} {'td/ref':>8} {'td/raw':>8} {'n':>5}  cmds td/ref/raw"
)


def _row(e: dict[str, Any]) -> str:
    n = e["tdstore"].get("n", "-")
    cmds = "/".join(_cmds(e[c]) for c in CONTENDERS)
    return (
        f"{e['case']:<14} {e['op']:<19} {_cell(e['tdstore']):>11} {_cell(e['reference']):>13} {_cell(e['raw']):>9} "
        f"{_ratio(e['ratio_ref']):>8} {_ratio(e['ratio_raw']):>8} {n!s:>5}  {cmds}"
    )


def print_table(report: dict[str, Any]) -> None:
    """The summary table: medians in ms and the two ratios (below 1: tdstore is faster)."""
    print()
    print(HEADER)
    print("-" * len(HEADER))
    for e in report["results"]:
        print(_row(e))
    if report.get("het_vs_hom"):
        print()
        print("heterogeneous reads against the homogeneous store's (tdstore ms / tdstore ms, side by side) or the raw floor:")
        for r in report["het_vs_hom"]:
            print(f"  {r['op']:<14} {_ratio(r['ratio']):>8}  against {r['against']}")
    mp = report.get("mp")
    if mp:
        print()
        print(
            f"multi-process: {mp['writers']} writers x {mp['seconds']:g} s of store[i] = td on {mp['count']:,} elements "
            "(element writes/s, higher is better)"
        )
        for name in CONTENDERS:
            line = mp.get(name, {"status": "unavailable"})
            value = f"{line['writes_per_s']:,.0f}" if line.get("status") == "ok" else f"{line.get('status')}: {line.get('error', '')}"
            print(f"  {name:<10} {value}")
        print(f"  tdstore/reference {_ratio(mp.get('ratio_ref'))}   tdstore/raw {_ratio(mp.get('ratio_raw'))}")
        learner = mp.get("learner") or {}
        if learner:
            print(
                f"learner under writers: sample({learner['batch']})/s alone and while {learner['writers']} processes extend "
                f"{learner['writer_rows']}-row batches (kept: loaded / idle, at least 0.5 is the goal)"
            )
            for name in CONTENDERS:
                line = learner.get(name, {"status": "unavailable"})
                if line.get("status") == "ok":
                    print(
                        f"  {name:<10} {line['idle_per_s']:,.0f}/s idle  {line['loaded_per_s']:,.0f}/s loaded  "
                        f"kept {line['kept']:.2f}x  writers {line['writer_rows_per_s']:,.0f} rows/s  "
                        f"server busy {line['server_cpu_share']:.0%} of a core"
                    )
                    niced = line.get("niced_writers")
                    if niced:  # the same writers yielding the CPU: what is left is the server's share
                        print(
                            f"  {'':<10} the same writers at nice 19: {niced['loaded_per_s']:,.0f}/s loaded  kept {niced['kept']:.2f}x  "
                            f"writers {niced['writer_rows_per_s']:,.0f} rows/s"
                        )
                else:
                    print(f"  {name:<10} {line.get('status')}: {line.get('error', '')}")
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    for note in report["notes"]:
        print(f"note: {note}")
