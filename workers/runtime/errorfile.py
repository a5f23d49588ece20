"""A rank's own failure, written where torch elastic looks for it: ``TORCHELASTIC_ERROR_FILE``, in
the format of torch's ``@record`` (so torchrun's summary quotes it), with the rank's global rank
added. The worker reads these files to say which rank failed first and why (``workers/failure.py``).

Installed in every rank: by ``train.py`` for the built-in workloads, by the injected
``sitecustomize`` for a user's script (loaded there by file path: it imports nothing but the
standard library, never torch). A script that uses torch's ``@record`` itself still gets this file:
torch writes it first, then the exception reaches the hook installed here, which writes it again
with the rank."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import time
import traceback
from types import TracebackType


def record_exception(exc: BaseException) -> None:
    """Writes ``exc`` to this rank's error file (nothing outside torch elastic, which sets its path)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
                "rank": os.environ.get("RANK", ""),
            },
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def install() -> None:
    """From here on, an exception that ends the rank is recorded before Python prints it (and a
    hard crash dumps every thread's stack, as torch's ``@record`` does)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            record_exception(exc)
        except Exception as error:  # never hide the script's own exception behind ours
            sys.stderr.write(f"torchyard: could not record the exception ({type(error).__name__}: {error})\n")
        previous(kind, exc, tb)

    sys.excepthook = hook
    with contextlib.suppress(Exception):  # no usable stderr: the traceback still reaches the error file
        faulthandler.enable(all_threads=True)
