"""Ingest's bounds on what a run can make the platform store: metric keys (their length and how
many a run may have) and log text (line length, volume per run). The sizes are settings
(``TORCHYARD_MAX_METRIC_KEYS``, ``..._MAX_LOG_LINE_BYTES``, ``..._MAX_LOG_BYTES_PER_RUN``) and
``streams.MAX_KEY_CHARS``; README's "Limits" lists them.

Nothing is dropped silently: each run counts what was cut or dropped (``run_counters``), its log
carries one warning line per kind (rank -1, rewritten as the count grows), and ``/metrics`` sums
the counts. Counts are of points and lines as delivered: a batch redelivered after a crash may be
counted twice; what is stored never is."""

from __future__ import annotations

import time
from collections import Counter
from enum import StrEnum
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from backend import bulk
from backend.models import LogLine, RunCounter, RunMetricKey
from torchyard.settings import Settings
from torchyard.streams import MAX_KEY_CHARS, cut_line

LOCKS = 0x7479  # the advisory lock space of runs' bounds (PostgreSQL), "ty"
LOG_BYTES = "log_bytes"  # the counter of log text stored, held against the volume bound


class Drop(StrEnum):
    """What a bound cut or dropped; each is a counter per run and a kind in Prometheus."""

    LONG_KEY = "dropped_points_long_key"
    KEY_LIMIT = "dropped_points_key_limit"
    LONG_LINE = "truncated_log_lines"
    LOG_VOLUME = "dropped_log_lines"


def warning(kind: Drop, count: int, settings: Settings) -> str:
    """The line a run's log shows for ``count`` drops of ``kind``."""
    match kind:
        case Drop.LONG_KEY:
            what = f"dropped {count:,} metric points whose key is longer than {MAX_KEY_CHARS} characters"
        case Drop.KEY_LIMIT:
            what = (
                f"dropped {count:,} metric points of new keys past this run's limit of "
                f"{settings.max_metric_keys:,} keys (TORCHYARD_MAX_METRIC_KEYS)"
            )
        case Drop.LONG_LINE:
            what = (
                f"cut {count:,} log lines longer than {settings.max_log_line_bytes:,} bytes "
                "(TORCHYARD_MAX_LOG_LINE_BYTES)"
            )
        case Drop.LOG_VOLUME:
            what = (
                f"dropped {count:,} log lines past this run's log limit of {settings.max_log_bytes_per_run:,} bytes "
                "(TORCHYARD_MAX_LOG_BYTES_PER_RUN)"
            )
    return f"torchyard: {what}"


class Bounds:
    """One ingest batch's view of its runs' bounds: made with the batch's metric keys and the runs
    its log lines are of; call :meth:`metric_keys` (and :meth:`drop_points`) and :meth:`logs`
    before the rows are inserted, :meth:`stored_logs` with the lines that were new, then
    :meth:`record`."""

    def __init__(self, session: Session, settings: Settings, keys: dict[int, set[str]], log_runs: set[int]) -> None:
        self.session, self.settings = session, settings
        self.drops: Counter[tuple[int, Drop]] = Counter()
        self.attempt: dict[int, int] = {}  # run → the attempt its warning lines are filed under
        self._line_bytes: dict[tuple[int, str, int], int] = {}
        self.known = self._known(set(keys))
        # Two ingest processes may hold batches of one run: a lock of the run's makes them take
        # turns where a bound is read and raised (its key count when a key is new, its log
        # budget), so one at a time does it. Only then: a batch of known keys, the usual one,
        # writes beside the other's. A transaction-scoped advisory lock, not the run's row: the
        # row lock would also stop the other's inserts (their foreign key checks share the row)
        # and its update of the run at the end, which would then wait in the other order.
        # PostgreSQL only; SQLite has one writer anyway.
        bound = sorted(log_runs | {run_id for run_id, run_keys in keys.items() if run_keys - self.known[run_id]})
        if bound and session.get_bind().dialect.name == "postgresql":
            for run_id in bound:  # in one order in every process
                session.execute(
                    text("SELECT pg_advisory_xact_lock(:space, :run_id)"), {"space": LOCKS, "run_id": run_id}
                )
            self.known.update(self._known(set(bound) & set(keys)))  # as the last holder left them
        self.log_bytes: dict[int, int] = {}
        if log_runs:
            rows = session.execute(
                select(RunCounter.run_id, RunCounter.value).where(
                    RunCounter.run_id.in_(sorted(log_runs)), RunCounter.name == LOG_BYTES
                )
            )
            self.log_bytes = {run_id: value for run_id, value in rows}

    def _known(self, run_ids: set[int]) -> dict[int, set[str]]:
        known: dict[int, set[str]] = {run_id: set() for run_id in run_ids}
        if run_ids:
            query = select(RunMetricKey.run_id, RunMetricKey.key).where(RunMetricKey.run_id.in_(sorted(run_ids)))
            for run_id, key in self.session.execute(query):
                known[run_id].add(key)
        return known

    def metric_keys(self, keys: dict[int, set[str]]) -> dict[int, set[str]]:
        """Of each run's ``keys``, those its points may be stored under: short enough and among
        the run's first ``max_metric_keys``; new keys are admitted in sorted order while there is
        room. The points of the others go: :meth:`drop_points` counts them."""
        allowed: dict[int, set[str]] = {}
        new_keys: list[dict[str, Any]] = []
        for run_id, run_keys in keys.items():
            known = self.known[run_id]
            room = max(0, self.settings.max_metric_keys - len(known))
            fresh = sorted(k for k in run_keys - known if len(k) <= MAX_KEY_CHARS)[:room]
            new_keys.extend({"run_id": run_id, "key": k} for k in fresh)
            allowed[run_id] = known | set(fresh)
        bulk.insert(self.session, RunMetricKey.__table__, new_keys)  # type: ignore[arg-type]
        return allowed

    def drop_points(self, run_id: int, key: str, count: int, attempt: int) -> None:
        """Counts ``count`` points of ``key`` that were not admitted (:meth:`metric_keys`)."""
        kind = Drop.LONG_KEY if len(key) > MAX_KEY_CHARS else Drop.KEY_LIMIT
        self.drops[run_id, kind] += count
        self.attempt[run_id] = attempt

    def logs(self, rows: list[dict[str, Any]], worker_cut: Counter[tuple[int, int]]) -> list[dict[str, Any]]:
        """Lines cut to ``max_log_line_bytes`` (saying how much went), then only as many as fit
        in what is left of the run's ``max_log_bytes_per_run``. The worker cuts lines as it reads
        them (``worker_cut``: how many, by run and attempt); a longer one (a worker with a larger
        limit) is cut here."""
        for (run_id, attempt), n in worker_cut.items():
            if n:
                self.drops[run_id, Drop.LONG_LINE] += n
                self.attempt[run_id] = attempt
        line_max, volume_max = self.settings.max_log_line_bytes, self.settings.max_log_bytes_per_run
        budget = {run_id: volume_max - self.log_bytes.get(run_id, 0) for run_id in {r["run_id"] for r in rows}}
        kept = []
        for row in rows:
            run_id = row["run_id"]
            text, cut = cut_line(row["text"], line_max)
            if cut:
                row = {**row, "text": text}
                self.drops[run_id, Drop.LONG_LINE] += 1
                self.attempt[run_id] = row["attempt"]
            data = text.encode(errors="replace")
            if len(data) > budget[run_id]:
                budget[run_id] = -1  # and every later line of this batch goes too: the log keeps its order
                self.drops[run_id, Drop.LOG_VOLUME] += 1
                self.attempt[run_id] = row["attempt"]
                continue
            budget[run_id] -= len(data)
            self._line_bytes[run_id, row["entry_id"], row["seq"]] = len(data)
            kept.append(row)
        return kept

    def stored_logs(self, written: list[tuple[Any, ...]]) -> None:
        """Charges the lines that were new (run_id, entry_id, seq) to their runs' volume: a
        redelivered line is not stored twice, nor counted twice."""
        added: Counter[int] = Counter()
        for run_id, entry_id, seq in written:
            added[run_id] += self._line_bytes.get((run_id, entry_id, seq), 0)
        self._add([(run_id, LOG_BYTES, n) for run_id, n in added.items()])

    def record(self) -> None:
        """Adds this batch's drops to the runs' counters and rewrites their warning lines."""
        if not self.drops:
            return
        self._add([(run_id, str(kind), n) for (run_id, kind), n in self.drops.items()])
        totals = self.session.execute(
            select(RunCounter.run_id, RunCounter.name, RunCounter.value).where(
                RunCounter.run_id.in_({run_id for run_id, _ in self.drops}),
                RunCounter.name.in_({str(kind) for _, kind in self.drops}),
            )
        )
        lines = [
            {
                "run_id": run_id,
                "entry_id": f"limit:{name}",  # one line per run and kind, rewritten in place
                "seq": 0,
                "attempt": self.attempt[run_id],
                "rank": -1,
                "ts": time.time(),
                "text": warning(Drop(name), value, self.settings),
            }
            for run_id, name, value in totals
        ]
        bulk.insert(
            self.session,
            LogLine.__table__,  # type: ignore[arg-type]
            lines,
            on_conflict="(run_id, entry_id, seq) DO UPDATE SET text = excluded.text, ts = excluded.ts",
        )

    def _add(self, counts: list[tuple[int, str, int]]) -> None:
        rows = [{"run_id": run_id, "name": name, "value": n} for run_id, name, n in counts if n]
        bulk.insert(
            self.session,
            RunCounter.__table__,  # type: ignore[arg-type]
            rows,
            on_conflict="(run_id, name) DO UPDATE SET value = t.value + excluded.value",
        )
