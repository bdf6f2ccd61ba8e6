"""What the demo shows a person: one status line per step of its start, live progress while it
runs, and the summary at the end.  Progress and status go to stderr, the summary where asked."""

from __future__ import annotations

from typing import Any, TextIO

__all__ = ["Progress", "Status", "plural", "print_summary"]


class Status:
    """One line on the progress stream per step of the demo's start (nothing with ``progress=False``)."""

    def __init__(self, enabled: bool, stream: TextIO) -> None:
        self._enabled = enabled
        self._stream = stream

    def __call__(self, text: str) -> None:
        if self._enabled:
            print(f"tdstore demo: {text}", file=self._stream, flush=True)


class Progress:
    """Live figures on stderr: a tqdm bar when tqdm is installed, else one line per second."""

    def __init__(self, seconds: float, enabled: bool, stream: TextIO) -> None:
        self._bar: Any = None
        self._enabled = enabled
        self._stream = stream
        self._next_line = 1.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=round(seconds, 1),
            unit="s",
            desc="demo",
            file=stream,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f}s{postfix}",
        )

    def update(self, elapsed: float, writes: int, reads: int, torn: int) -> None:
        """Show the figures after ``elapsed`` seconds (the bar on each call, a line once a second)."""
        if not self._enabled:
            return
        rate_w = writes / elapsed if elapsed > 0 else 0.0
        rate_r = reads / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.n = round(min(elapsed, self._bar.total), 1)
            self._bar.set_postfix_str(f"writes {writes} ({rate_w:.0f}/s), batch reads {reads} ({rate_r:.0f}/s), torn {torn}", refresh=False)
            self._bar.refresh()
        elif elapsed >= self._next_line:
            self._next_line += 1.0
            print(
                f"[{elapsed:5.1f}s] writes {writes} ({rate_w:.0f}/s)  batch reads {reads} ({rate_r:.0f}/s)  torn {torn}",
                file=self._stream,
                flush=True,
            )

    def close(self) -> None:
        """Close the bar (the line fallback needs nothing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def print_summary(f: dict[str, Any], out: TextIO, samples_per_insert: float) -> None:
    """The human-readable result: throughput, torn count, final verification (``samples_per_insert``: the
    rate limiter's ratio, shown next to the one measured when the run had one)."""
    per_actor = ", ".join(str(w) for w in f["writes_per_actor"])
    lines = [
        f"tdstore demo on {f['server']}",
        f"  {plural(f['actors'], 'actor')}, {plural(f['count'], 'element')}, batches of {f['batch']}, {f['seconds']:.2f} s",
        f"  writes : {f['writes']} element writes, {f['writes_per_s']:.0f}/s in total (per actor: {per_actor})",
        f"  reads  : {f['reads']} batch reads, {f['reads_per_s']:.0f}/s; {f['elements_read']} elements, {f['elements_read_per_s']:.0f}/s",
        f"  torn   : {f['torn']} torn elements seen while sampling",
        *(
            [
                f"  ratio  : {f['samples_per_insert']:g} rows sampled per row written "
                f"(the server's rate limiter: {samples_per_insert:g}, writers at most {2 * f['count']} rows ahead)"
            ]
            if "samples_per_insert" in f
            else []
        ),
        f"  final  : {f['verified']}/{f['count']} elements verified ({f['inconsistent']} inconsistent, {f['lost_writes']} lost writes)",
        f"  cleanup: {f['keys_deleted']} keys deleted",
    ]
    lines += [f"  torn example: {e}" for e in f["torn_examples"]]
    lines += [f"  final example: {e}" for e in f["final_examples"]]
    lines.append("  OK: no torn or inconsistent element" if f["ok"] else "  FAILED: torn or inconsistent elements (see above)")
    print("\n".join(lines), file=out, flush=True)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
