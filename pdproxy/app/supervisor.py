"""``pdproxy serve --workers N``: N worker processes on one listening socket that behave as one proxy.

Why not uvicorn's own ``--workers``: each worker would then route with only its own leases in view, admit its own
prefill budget and find a dead engine on its own (the vLLM-Ascend example proxy shares state through a
``multiprocessing`` manager instead, which costs a cross-process round trip per request).  Here the supervisor
(this module, in the parent process):

1. binds the listening socket once (workers inherit it; the kernel hands each new connection to one of them);
2. creates a run directory (under ``/dev/shm`` when writable) holding the :class:`~pdproxy.workers.board.LoadBoard`
   file — one row per worker, written only by that worker, summed by readers, plus one breaker record per
   endpoint — one wake-up FIFO per worker (:mod:`pdproxy.workers.wakeup`) and, unless ``PROMETHEUS_MULTIPROC_DIR`` is
   already set, the prometheus multiprocess directory (see :mod:`pdproxy.ops.metrics`);
3. spawns N workers (``multiprocessing`` spawn context; worker ``k`` owns board row ``k``), each a normal pdproxy
   app on uvicorn's server with pdproxy's own HTTP protocol (:mod:`pdproxy.http.server`) whose state is built on the
   board (:mod:`pdproxy.workers.share`);
4. supervises: a worker that dies is replaced, after its board row is zeroed (its leases, prefill reservations
   and half-open trials died with it) and the other workers are woken to re-check their waiters, and its
   prometheus live-gauge files are dropped; a worker that dies before its row was ever ready is a start-up
   failure, which stops everything (exit code 1) instead of restarting in a loop, while a replacement that dies
   before it is ready (the OOM killer again, a crash that repeats) is started again after a backoff (1 s, doubling
   to 30 s; reset once one is ready) — the other workers serve meanwhile;
5. on SIGTERM / SIGINT sends every worker SIGTERM (each drains for ``shutdown_grace_s``:
   :mod:`pdproxy.app.shutdown`), and on a second one SIGTERM again (each worker then cuts its requests in flight, as
   one process does on Ctrl-C again), waits, then kills stragglers and removes the run directory.  Always SIGTERM:
   a worker still starting (importing, building its app: ~2 s) has no handler yet, and SIGTERM's default ends it
   quietly where SIGINT's would raise ``KeyboardInterrupt`` in it.  Workers run in their
   own process group, so a terminal's Ctrl-C reaches only the supervisor.  A supervisor that died without that
   (SIGKILL, the OOM killer) leaves its run directory; the next one started removes it (:func:`run_directory`).

Workers exit on their own if the supervisor disappears (they watch their parent pid).

**Shared** (one for all workers): in-flight requests and tokens per endpoint (routing scores, ``/metrics``,
``/debug/load``); the prefill ledger — the per-prefiller prefill budget's counts, the prefiller KV-pool guard and
the decoders' reservation (:mod:`pdproxy.workers.ledger`: a grant re-checks under an ``flock`` when another grant
happened since it read the room, so the bounds hold exactly across workers); each endpoint's circuit breaker
(:mod:`pdproxy.workers.breaker`: a failure in any worker counts for all, an open breaker is open for all, a
half-open breaker admits one trial in all); the order of prefill waiters (a worker does not grant ahead of another
worker's first blocked waiter with a smaller key).
**Per worker**: the prefill queue's waiters themselves (each worker orders and wakes its own; another worker's
release wakes it through its FIFO, the queue's poll is the safety net), health probes and ``healthy`` flags
(each worker probes every engine), engine info, connections and the request path.
**Costs** (loadtest/workers_bench.py, 2-core machine shared with other work): per PD request, the board's pool
adds ≈ 14 µs of CPU over a single process and the shared ledger and breakers ≈ 14 µs more (one ``flock`` pair ≈
1 µs of it); a release while another worker has waiters adds one FIFO write (≈ 1 µs) per such worker; prometheus
multiprocess metrics cost more than in-process ones.  End to end, 2 workers relay ≈ 0.85–1.0× the events per
worker CPU-second of one worker and spend ≈ 100 µs more CPU per PD request, as before the sharing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdproxy.ops.logs import listen_urls, log_banner
from pdproxy.ops.metrics import MULTIPROC_ENV
from pdproxy.settings import Settings
from pdproxy.workers.board import LoadBoard
from pdproxy.workers.share import WorkerShare
from pdproxy.workers.wakeup import WakeChannels, create_fifos

log = logging.getLogger("pdproxy.workers")

STARTUP_FAILURE = 3
BOARD_FILE = "load.board"


RUN_DIR_PREFIX = "pdproxy-"
OWNER_LOCK = "owner.lock"
"""The file in a run directory its supervisor holds an ``flock`` on for its whole life (:func:`run_directory`)."""


@contextlib.contextmanager
def run_directory() -> Iterator[Path]:
    """A private directory (``pdproxy-*``) for the board and metrics files, in shared memory when possible; removed
    on exit.  Its supervisor holds an exclusive ``flock`` on its :data:`OWNER_LOCK` from before the directory has
    its name until it is removed; first, the run directories a supervisor left when it died without its cleanup
    (SIGKILL, the OOM killer: ``/dev/shm`` is memory) are removed (:func:`remove_orphaned_run_dirs`)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    parent = Path(base or tempfile.gettempdir())
    removed = remove_orphaned_run_dirs(parent)
    if removed:
        log.info("pdproxy: removed %d run director%s left by supervisors that died: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(map(str, removed)))
    staging = Path(tempfile.mkdtemp(prefix="." + RUN_DIR_PREFIX, dir=parent))   # no scan looks at it yet
    lock_fd = os.open(staging / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)  # workers never hold it
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        path = parent / staging.name[1:]
        os.rename(staging, path)                  # named only once locked: a scan never finds it unlocked
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(lock_fd)


def remove_orphaned_run_dirs(parent: Path) -> list[Path]:
    """Remove the run directories in ``parent`` whose supervisor is gone — those of this user whose
    :data:`OWNER_LOCK` this process can lock (the kernel drops a dead process's locks, whatever its PID
    namespace: a live supervisor in another container sharing ``/dev/shm`` keeps its own) — and return them.  A
    directory without the lock file (an older pdproxy's, or not pdproxy's) is left alone."""
    removed: list[Path] = []
    for path in sorted(parent.glob(RUN_DIR_PREFIX + "*")):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:                           # held: its supervisor lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def listening_socket(host: str, port: int) -> Iterator[socket.socket]:
    """The shared listening socket (IPv4/IPv6 by ``host``), inheritable by the workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    try:
        yield sock
    finally:
        sock.close()


def prepare_metrics_dir(run_dir: Path) -> Path:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` for the workers (ours, or the operator's, cleared of stale ``*.db``)."""
    given = os.environ.get(MULTIPROC_ENV)
    path = Path(given) if given else run_dir / "metrics"
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def worker_main(settings: Settings, sock: socket.socket, board_path: str, row: int) -> None:
    """Entry point of worker ``row`` (runs in the spawned process)."""
    from pdproxy.app.application import PDProxyApp
    from pdproxy.app.shutdown import CancelledLifespanFilter, DrainingServer
    from pdproxy.http.server import uvicorn_config
    from pdproxy.http.tls import apply_to_uvicorn, server_ssl_context
    from pdproxy.ops.heap import apply_heap_policy
    from pdproxy.ops.logs import configure_logging

    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor only; it sends SIGTERM (drain; a second one cuts)
    configure_logging(settings, worker=row)
    logging.getLogger("uvicorn.error").addFilter(CancelledLifespanFilter())   # a second Ctrl-C's forced exit
    apply_heap_policy(settings.malloc_trim_threshold_mib)
    parent = os.getppid()
    with LoadBoard.attach(Path(board_path), settings.all_endpoints(), settings.workers) as board:
        wake = WakeChannels(Path(board_path).parent, settings.workers, row)
        app = PDProxyApp(settings, share=WorkerShare(board, row, wake))
        config = uvicorn_config(app, timeout_graceful_shutdown=1, log_config=None)  # own HTTP protocol (server.py)
        apply_to_uvicorn(config, server_ssl_context(settings))  # each worker builds its own (contexts don't pickle)
        server = DrainingServer(config, app, grace_s=settings.shutdown_grace_s, delay_s=settings.shutdown_delay_s,
                                handshake_timeout_s=settings.request_headers_timeout_s)  # SIGTERM drains (shutdown.py)

        def watch() -> None:  # mark the row ready once serving; leave if the supervisor is gone
            while not server.should_exit:
                if server.started and not board.owner(row)[1]:
                    board.mark_ready(row)
                if os.getppid() != parent:
                    server.should_exit = True
                time.sleep(0.05 if not server.started else 0.5)

        threading.Thread(target=watch, name="pdproxy-worker-watch", daemon=True).start()
        server.run(sockets=[sock])
        started = server.started
    if not started:
        sys.exit(STARTUP_FAILURE)


RESPAWN_MAX_S = 30.0
"""The longest wait before starting a row's worker again after replacements that died before they were ready."""


class Supervisor:
    """Starts, watches and stops the worker processes (see module docstring)."""

    def __init__(self, settings: Settings, sock: socket.socket, board: LoadBoard) -> None:
        self.settings = settings
        self.sock = sock
        self.board = board
        self.wake = WakeChannels(board.path.parent, settings.workers, None)
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = [None] * settings.workers
        self.ready_once = [False] * settings.workers
        """Rows whose worker was ready at least once: a later death before ready is a crash, not a start-up failure."""
        self.respawn_at: list[float | None] = [None] * settings.workers
        """When a row whose replacement died before it was ready is started again (``time.monotonic()``)."""
        self.crashes = [0] * settings.workers
        """Replacements of a row that died before they were ready, in a row (the backoff's exponent)."""
        self.stop = threading.Event()
        self.signals = 0
        """SIGTERM / SIGINT received (the handler only counts; :meth:`shutdown` passes them on as SIGTERM)."""

    def spawn(self, row: int) -> None:
        """Start worker process ``row`` on a zeroed load-board row and record its pid."""
        self.board.clear(row)
        proc = self.ctx.Process(target=worker_main, name=f"pdproxy-worker-{row}",
                                args=(self.settings, self.sock, str(self.board.path), row))
        proc.start()
        self.board.set_owner(row, proc.pid or 0)
        self.procs[row] = proc
        log.info("worker %d started (pid %s)", row, proc.pid)

    def reap(self, row: int) -> bool:
        """Handle worker ``row`` having exited.  Returns False if it was a start-up failure (the row's first
        worker died before it was ready); a replacement that died before it was ready gets its row a restart time
        (:attr:`respawn_at`, backoff 1 s doubling to :data:`RESPAWN_MAX_S`) instead of an immediate one."""
        proc = self.procs[row]
        _, ready = self.board.owner(row)
        self.board.clear(row)   # its leases, prefill reservations and breaker trials died with it
        self.wake.wake_all()    # capacity came back: the other workers' waiters re-check
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid)
        if ready:
            self.ready_once[row] = True
            self.crashes[row] = 0
        elif not self.ready_once[row]:
            log.error("worker %d (pid %s) exited with code %s before it was ready; stopping", row, proc.pid,
                      proc.exitcode)
            return False
        else:
            wait = min(RESPAWN_MAX_S, 2.0 ** min(self.crashes[row], 8))
            self.crashes[row] += 1
            self.respawn_at[row] = time.monotonic() + wait
            log.warning("worker %d (pid %s) exited with code %s before it was ready; starting a new one in %.0f s",
                        row, proc.pid, proc.exitcode, wait)
            return True
        log.warning("worker %d (pid %s) exited with code %s; starting a new one", row, proc.pid, proc.exitcode)
        return True

    def run(self) -> int:
        """Run until SIGTERM/SIGINT.  Returns the process exit code."""
        def stop(sig: int, _frame: object) -> None:
            name = signal.Signals(sig).name
            self.signals += 1
            if self.signals == 1:
                log.info("pdproxy: %s: stopping %d worker(s) (each drains up to %.0f s; a second signal cuts "
                         "their requests in flight)", name, len(self.procs), self.settings.shutdown_grace_s,
                         extra={"event": "shutdown_started", "signal": name})
            elif self.signals == 2:
                log.warning("pdproxy: %s again: the workers cut their requests in flight now", name,
                            extra={"event": "shutdown_forced", "signal": name})
            self.stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        code = 0
        try:
            for row in range(len(self.procs)):
                self.spawn(row)
            while not self.stop.wait(0.2):
                for row, proc in enumerate(self.procs):
                    due = self.respawn_at[row]
                    if due is not None:                  # a crashed replacement's row, waiting out its backoff
                        if time.monotonic() >= due:
                            self.respawn_at[row] = None
                            self.spawn(row)
                        continue
                    if proc.is_alive():
                        if not self.ready_once[row] and self.board.owner(row)[1]:
                            self.ready_once[row] = True
                        if self.crashes[row] and self.board.owner(row)[1]:
                            self.crashes[row] = 0        # a replacement became ready: the backoff starts over
                        continue
                    proc.join()
                    if not self.reap(row):
                        code = 1
                        self.stop.set()
                        break
                    if self.respawn_at[row] is None:
                        self.spawn(row)
        finally:
            self.shutdown()
            self.wake.close()
        return code

    def shutdown(self) -> None:
        """SIGTERM every worker, and again when a second signal comes (the workers cut their requests in flight:
        pdproxy/app/shutdown.py), wait up to the grace period (+5 s), then SIGKILL the rest."""
        alive = [p for p in self.procs if p is not None and p.is_alive()]
        sent = 0
        deadline = time.monotonic() + self.settings.shutdown_delay_s + self.settings.shutdown_grace_s + 5.0
        while alive:
            if sent < min(max(self.signals, 1), 2):     # the first signal; then Ctrl-C again, once
                for proc in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
                sent += 1
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            alive[0].join(min(left, 0.1))
            alive = [p for p in alive if p.is_alive()]
        for proc in alive:
            log.warning("worker pid %s did not stop in time: SIGKILL", proc.pid)
            proc.kill()
            proc.join()


def serve_workers(settings: Settings) -> int:
    """Run ``settings.workers`` worker processes behind one socket until interrupted (see module docstring)."""
    endpoints = settings.all_endpoints()
    with run_directory() as run_dir, listening_socket(settings.host, settings.port) as sock, \
            LoadBoard.create(run_dir / BOARD_FILE, endpoints, settings.workers) as board:
        metrics_dir = prepare_metrics_dir(run_dir)
        create_fifos(run_dir, settings.workers)
        log_banner(settings, listen_urls([sock.getsockname()], bool(settings.ssl_certfile)), workers=settings.workers)
        log.info("pdproxy: run directory %s (load board %s, metrics %s)", run_dir, board.path, metrics_dir)
        code = Supervisor(settings, sock, board).run()
        log.info("pdproxy: shutdown complete (workers stopped)", extra={"event": "shutdown_done"})
        return code
