"""torchyard's instrumentation for a user's own, unmodified script.

The launcher puts this folder first on a script run's ``PYTHONPATH``, so Python imports this
module at start-up in every process of the run. It does anything only in a training rank
(``TORCHYARD_INSTRUMENT=1`` and torchrun's ``RANK`` set): there it installs
``workers/runtime/errorfile.py`` (the exception that ends the rank, recorded for the run's failure
reason) and ``workers/runtime/autoinstrument.py``, which waits for ``import torch`` and then times
DDP's gradient communication and the optimizer's steps (see that module). It never imports torch itself.

Our modules load by file path under private names, so a user's own ``workers`` package still
imports as theirs. Any failure is printed once and the script runs uninstrumented. A
``sitecustomize`` further along ``sys.path`` (the environment's own) still runs.
"""

import atexit
import gc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _install() -> None:
    if os.environ.get("TORCHYARD_INSTRUMENT") != "1" or "RANK" not in os.environ:
        return
    # DDP keeps its reducer (and through it the process group) in reference cycles, so an
    # unmodified script's model outlives its function and dies in interpreter teardown, where
    # torch 2.13 with Gloo aborts ("terminate called without an active exception") in about 1 exit
    # of 5 here, after the last step: the run would fail. Collected while the interpreter is whole
    # (registered first, so it runs last of the atexit hooks), 0 aborts in 30.
    atexit.register(gc.collect)
    runtime = os.path.join(os.path.dirname(_HERE), "runtime")
    # The exception that ends the rank goes to torch elastic's error file: the run's failure reason.
    _load("_torchyard_errorfile", os.path.join(runtime, "errorfile.py")).install()  # type: ignore[attr-defined]
    _load("_torchyard_autoinstrument", os.path.join(runtime, "autoinstrument.py")).install()  # type: ignore[attr-defined]


def _chain() -> None:
    """Run the next sitecustomize on sys.path, as if this one were not here."""
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != _HERE and os.path.isfile(candidate):
            _load("_torchyard_next_sitecustomize", candidate)
            return


try:
    _install()
except Exception as exc:  # never break the script
    sys.stderr.write(f"torchyard: instrumentation is off for this process ({type(exc).__name__}: {exc})\n")
try:
    _chain()
except Exception as exc:
    sys.stderr.write(f"torchyard: the environment's sitecustomize failed ({type(exc).__name__}: {exc})\n")
