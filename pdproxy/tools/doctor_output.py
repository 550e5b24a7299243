"""What ``pdproxy doctor`` prints while it runs: report rows as each check completes, and cold-probe progress.

- **rows** (stdout, table mode): a header first, then one row per check the moment it is added to the report, in
  fixed columns (the widths come from the configured engines, known before any check runs), then the summary
  line.  With ``--json`` nothing goes to stdout until the single JSON document at the end.
- **progress** (stderr, both modes): each cold-probe attempt when it starts (engine, prompt tokens, how long it
  is given) and ends (outcome, seconds), and while attempts run a tick every ``tick_s`` seconds with their
  elapsed time.  On a terminal the tick rewrites one status line in place; otherwise each tick is a line.

Not thread-safe: one event loop drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, TextIO

from pdproxy.tools.doctor_probes import Outcome

if TYPE_CHECKING:
    from pdproxy.tools.doctor import Check, Report

CHECK_WIDTH = len("kv_connector")


def status_text(status: str) -> str:
    """How a status is shown in the table: problems in capitals (``WARN``, ``FAIL``), the rest as is."""
    return status.upper() if status in ("warn", "fail") else status


class Console:
    """Streams the report (see module docstring).  ``targets``: every target name a row may carry (engine
    names, ``"p → d"`` pairs, ``"P/D"``); ``table``: print rows to ``out`` (False with ``--json``);
    ``tty``: rewrite the progress line in place (default: ``err.isatty()``)."""

    def __init__(self, targets: Iterable[str], *, table: bool, out: TextIO | None = None, err: TextIO | None = None,
                 tty: bool | None = None, tick_s: float | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.table = table
        self.tty = self.err.isatty() if tty is None else tty
        self.tick_s = tick_s if tick_s is not None else (0.5 if self.tty else 5.0)
        self.target_width = max([len("ENGINE"), *(len(t) for t in targets)])
        self.running: dict[tuple[str, int], tuple[float, float]] = {}  # (engine, tokens) → (started, wait_s)
        self._status_shown = False

    # --- rows ---------------------------------------------------------------------------------------------
    def _line(self, check: str, target: str, status: str, detail: str) -> str:
        return f"{check:<{CHECK_WIDTH}}  {target:<{self.target_width}}  {status:<6}  {detail}"

    def header(self, engines: int, budget_s: float) -> None:
        """Say what is being checked and for how long at most, then the table header."""
        self.note(f"pdproxy doctor: checking {engines} engine(s); the run ends within {budget_s:g} s")
        if self.table:
            self._clear_status()
            print(self._line("CHECK", "ENGINE", "STATUS", "DETAIL"), file=self.out, flush=True)

    def row(self, c: Check) -> None:
        """Print one check (table mode only)."""
        if self.table:
            self._clear_status()
            print(self._line(c.check, c.target, status_text(c.status), c.detail), file=self.out, flush=True)

    def footer(self, report: Report, elapsed_s: float) -> None:
        """The summary line after the last row (table mode), and the run time (stderr)."""
        self._clear_status()
        if self.table:
            fails, warns = (sum(c.status == s for c in report.checks) for s in ("fail", "warn"))
            print(f"\n{'OK' if report.ok else 'PROBLEMS FOUND'}: {fails} problem(s), {warns} warning(s), "
                  f"{len(report.checks)} check(s)", file=self.out, flush=True)
        self.note(f"pdproxy doctor: done in {elapsed_s:.1f} s")

    # --- progress -----------------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        """One progress line on stderr."""
        self._clear_status()
        print(text, file=self.err, flush=True)

    def attempt_started(self, endpoint: str, tokens: int, wait_s: float) -> None:
        """A cold prompt was sent (:class:`pdproxy.tools.doctor_probes.ProbeProgress`)."""
        self.running[(endpoint, tokens)] = (time.monotonic(), wait_s)
        self.note(f"  cold_context {endpoint}: sending {tokens:,} tokens (given {wait_s:.0f} s)")

    def attempt_ended(self, endpoint: str, tokens: int, outcome: Outcome, elapsed_s: float) -> None:
        """A cold prompt completed, stalled or failed."""
        self.running = {k: v for k, v in self.running.items() if k[0] != endpoint}
        said = {"ok": "completed", "stalled": "stalled (no answer; aborted)", "error": "failed"}[outcome]
        self.note(f"  cold_context {endpoint}: {tokens:,} tokens {said} after {elapsed_s:.1f} s")

    def tick(self) -> None:
        """Show the elapsed time of every running attempt."""
        if not self.running:
            return
        now = time.monotonic()
        parts = [f"{e}: {n:,} tokens, {now - t0:.0f} s of {wait:.0f} s" for (e, n), (t0, wait) in self.running.items()]
        if self.tty:
            self.err.write("\r\033[K  waiting — " + " | ".join(parts))
            self.err.flush()
            self._status_shown = True
        else:
            for p in parts:
                print(f"  cold_context {p}", file=self.err, flush=True)

    def _clear_status(self) -> None:
        if self._status_shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self._status_shown = False

    @contextlib.asynccontextmanager
    async def ticking(self) -> AsyncIterator[None]:
        """Run :meth:`tick` every ``tick_s`` seconds while the block runs."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.tick_s)
                self.tick()

        task = asyncio.get_running_loop().create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._clear_status()
