"""Hang dumps: what a rank writes when the platform asks why a run is stuck, and how it is asked.
The contract between the ranks (``workers/runtime/hangdump.py`` writes), the worker
(``workers/diagnose.py`` collects) and the server (``backend/diagnosis.py`` compares).

The walk: the api (a user's "diagnose") or the watchdog (a stall) sets the attempt's diagnose key
(``streams.diagnose_key``) to a request id; each worker running a share of the attempt sees it,
writes the id into :data:`REQUEST_FILE` in the share's run directory (ranks cannot read Redis),
and each rank's dump thread answers with :func:`dump_file`. The worker sends the dumps it got
within :data:`RANK_ANSWER_S` to the platform stream as one ``diagnosis`` entry per node.

A dump (JSON object, at most :data:`MAX_DUMP_BYTES`):

- ``version`` (1), ``request``, ``rank``, ``local_rank``, ``world``, ``pid``, ``time`` (unix s);
- ``flight_recorder``: torch's own Flight Recorder JSON (``_dump_fr_trace_json``: ``entries``,
  ``pg_status``, ...), its ``entries`` cut to the newest :data:`MAX_ENTRIES`; ``null`` when the
  rank has no process group yet; ``error``: why it could not be read;
- ``flight_recorder_cuda``: the same for NCCL's recorder (``_dump_nccl_trace_json``), which CUDA
  builds keep apart; ``null`` without one (a CPU build) or when it is the same ring;
- ``groups``: ``{group name: {"desc": ..., "ranks": [global ranks]}}`` (torch's Gloo recorder
  leaves its ``pg_config`` empty, so the rank says itself who is in each group);
- ``threads``: every Python thread, ``{"id", "name", "main", "frames": [{"file", "line", "func",
  "code", "lib"}], "cut"}``, frames outermost first and the innermost :data:`MAX_FRAMES` kept
  (``cut``: how many outer ones were left out); ``lib``: the frame is in the standard library or
  an installed package, not the run's own code.
"""

from __future__ import annotations

import re

VERSION = 1
REQUEST_FILE = "diagnose-request"  # in the run directory: the worker writes the request id there
POLL_S = 0.2  # how often a rank's dump thread looks for a request
RANK_ANSWER_S = 5.0  # how long a worker waits for its ranks' dumps
# How long the watchdog waits for a stalled attempt's dumps before ending it anyway: the worker's
# wait, its poll of the key, the scheduler's pass and ingest's, with room to spare.
STALL_WAIT_S = RANK_ANSWER_S + 5.0

MAX_DUMP_BYTES = 256 * 1024  # one rank's dump; a larger one is refused by the worker
MAX_ENTRIES = 200  # Flight Recorder entries kept per dump (the newest)
MAX_THREADS = 32
MAX_FRAMES = 40  # per thread, the innermost
MAX_CODE_CHARS = 200  # the source line of a frame

# torch reads this for every backend (Gloo too); the older name is the NCCL one.
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"

_REQUEST = re.compile(r"^[0-9a-f]{8,64}$")


def dump_file(local_rank: int) -> str:
    """The answer of the rank with this local rank, in the run directory."""
    return f"diagnose-rank{local_rank}.json"


def valid_request(value: str) -> bool:
    """A request id: hex, as the server makes them (anything else in a request file is ignored)."""
    return bool(_REQUEST.match(value))
