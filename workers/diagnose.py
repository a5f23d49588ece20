"""A share's answer to a diagnose request (``torchyard/hangdump.py``): the launcher's supervision
loop polls the attempt's diagnose key; a new request id goes into the run directory's request file,
and the dumps the ranks write within ``RANK_ANSWER_S`` go to the platform stream as one
``diagnosis`` entry, with the ranks that stayed silent and why.

The dumps are the ranks' files in the ranks' own directory: read as untrusted data. A file is
opened without following links (a rank's link to a file of root's is refused, never read out to the
server), must be a regular file within ``MAX_DUMP_BYTES`` and a JSON object answering this request."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from torchyard import hangdump, streams
from torchyard.runfiles import NotRegular, RunDir, TooLarge
from workers.output import send
from workers.rundirs import write_marker

log = logging.getLogger(__name__)


class DiagnoseWatch:
    """Answers each new diagnose request of one share once, in a thread of its own (the
    supervision loop goes on polling the cancel meanwhile)."""

    def __init__(self, client: redis.Redis, run_id: int, attempt: int, node_id: str, run_dir: Path, procs: int) -> None:
        self.client, self.run_id, self.attempt, self.node_id = client, run_id, attempt, node_id
        self.run_dir, self.procs = run_dir, procs
        self.answered = ""
        self.thread: threading.Thread | None = None

    def poll(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
        try:
            value: Any = self.client.get(streams.diagnose_key(self.run_id, self.attempt))
        except redis.RedisError:
            return  # asked again on the next tick
        request = value.decode(errors="replace") if value else ""
        if request == self.answered or not hangdump.valid_request(request):
            return
        self.answered = request
        self.thread = threading.Thread(
            target=self._answer, args=(request,), name=f"diagnose-{self.run_id}", daemon=True
        )
        self.thread.start()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def _answer(self, request: str) -> None:
        try:
            dumps, missing = collect(self.run_dir, self.procs, request)
        except Exception as exc:  # e.g. the run directory went with the share
            log.warning("run %s: could not collect the hang dumps: %s", self.run_id, exc)
            dumps, missing = [], {str(n): f"not asked: {exc}" for n in range(self.procs)}
        data = {"attempt": self.attempt, "node": self.node_id, "request": request, "procs": self.procs}
        try:
            send(self.client, self.run_id, streams.DIAGNOSIS, {**data, "dumps": dumps, "missing": missing})
        except RuntimeError as exc:
            log.warning("run %s: %s", self.run_id, exc)


def collect(
    run_dir: Path,
    procs: int,
    request: str,
    wait_s: float = hangdump.RANK_ANSWER_S,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Asks the share's ranks and waits (at most ``wait_s`` by ``clock``) for their dumps. Returns
    the dumps and, by local rank, why the others are missing."""
    for local in range(procs):  # an answer to an earlier request is no answer to this one
        (run_dir / hangdump.dump_file(local)).unlink(missing_ok=True)
    write_marker(run_dir / hangdump.REQUEST_FILE, request)
    deadline = clock() + wait_s
    dumps: dict[int, dict[str, Any]] = {}
    why: dict[int, str] = {}
    while True:
        for local in range(procs):
            if local not in dumps:
                dump, why[local] = read_dump(run_dir / hangdump.dump_file(local), request)
                if dump is not None:
                    dumps[local] = dump
        if len(dumps) == procs or clock() > deadline:
            break
        time.sleep(0.05)
    missing = {str(n): reason for n, reason in sorted(why.items()) if n not in dumps}
    return [dumps[n] for n in sorted(dumps)], missing


NO_ANSWER = f"no answer within {hangdump.RANK_ANSWER_S:g} s (the process is gone, or a thread holds the GIL)"


def read_dump(path: Path, request: str) -> tuple[dict[str, Any] | None, str]:
    """A rank's dump answering ``request``, or None and why not."""
    try:  # the rank wrote it: read as everything a run writes is (torchyard/runfiles.py)
        with RunDir.open(path.parent) as directory:
            raw = directory.read(path.name, hangdump.MAX_DUMP_BYTES)
    except FileNotFoundError:
        return None, NO_ANSWER
    except NotRegular:
        return None, "its dump is not a regular file"
    except TooLarge:
        return None, f"its dump is larger than {hangdump.MAX_DUMP_BYTES} bytes"
    except OSError as exc:
        return None, f"its dump cannot be opened ({exc.strerror or exc}; a link is refused)"
    try:
        dump = json.loads(raw)
    except ValueError:
        return None, "its dump is not JSON"
    if not isinstance(dump, dict):
        return None, "its dump is not a JSON object"
    if dump.get("request") != request:
        return None, NO_ANSWER  # an older answer, or one being replaced
    return dump, ""
