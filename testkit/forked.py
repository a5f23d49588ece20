"""Ranks forked from a warm interpreter, for tests of what ranks compute (losses, counted
collectives, shares of the parameters) rather than of how torch elastic starts and ends them.

A rank under torchrun spends ~3 s of CPU before its first step, whatever it then does (``python -m
benchmarks.launch_cost``: ``import torch`` 1.5 s, ``torch._dynamo`` 1.3 s, which DDP's ``__init__``
and every optimizer's ``step`` import), and torchrun's own agent 1.5 s more: on this suite's 2
cores the modules that compare a dozen strategies spent most of their time importing. Here one
process per test worker imports all that once (``python -m testkit.forked``) and forks each
rank of a gang from it: the rank runs its unchanged entry point (``workers.runtime.train``'s
``main``) with the variables torchrun would set for it, in a real Gloo process group across real
processes. What torchrun itself does (restarts, ending a gang when one rank fails, the error
file) stays tested under torchrun (``testkit/torchrun.py``); a failed rank here ends its gang the
same way (SIGTERM to the others, SIGKILL after a grace).

The protocol, one gang at a time: a JSON line on stdin ``{"id": n, "envs": [...], "logs": dir,
"timeout": s}``, a JSON line back ``{"id": n, "codes": [...], "timed_out": bool}`` once every rank
has ended."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# What every rank would import: torch._dynamo because DDP's __init__ and every optimizer step do.
PRELOADED = ("torch", "torch._dynamo", "torch.distributed.fsdp", "workers.runtime.train")
GRACE_S = 5.0  # a failed rank's peers get this long after the SIGTERM, as torchrun's would


class Forked:
    """The test side: starts the warm process, sends it gangs."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        # libgomp reads OMP_NUM_THREADS once, when torch loads it: in the warm process, before any fork.
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.forked"], cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.sent = 0  # requests sent: each answer names the request it answers

    def run(self, envs: list[dict[str, str]], logs: Path, timeout: float) -> tuple[list[int], bool]:
        """Forks one rank per environment, waits for all: their exit codes and whether the gang
        was ended for running past ``timeout``. Each rank's stdout and stderr go to ``logs/rank-N.log``."""
        assert self.proc.stdin and self.proc.stdout
        self.sent += 1
        request = {"id": self.sent, "envs": envs, "logs": str(logs), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while True:  # an earlier gang's answer, its test interrupted (a timeout) while it waited, is skipped
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the warm rank process ended (exit {self.proc.wait()})")
            answer = json.loads(line)
            if answer["id"] == self.sent:
                return answer["codes"], answer["timed_out"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # end of input: it exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rank_environments(base: dict[str, str], procs: int, port: int) -> list[dict[str, str]]:
    """What torchrun --standalone gives each of ``procs`` local ranks, over ``base``."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(procs)}
    common |= {"LOCAL_WORLD_SIZE": str(procs), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(procs)}
    return [{**base, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(procs)]


# The warm process.


def _rank(env: dict[str, str], log: Path) -> None:
    """In the forked child: become the rank, run its entry point, never return."""
    code = 1
    try:
        os.setsid()  # its own group: its loader processes go with it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the requests are the warm process's, not the rank's
        os.close(null)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["workers.runtime.train"]
        from workers.runtime import errorfile, train

        errorfile.install()
        train.main()  # ends the process itself (os._exit) once its metrics are in Redis
        code = 0
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _gang(request: dict[str, Any]) -> dict[str, Any]:
    logs = Path(request["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    pids = {}
    for rank, env in enumerate(request["envs"]):
        pid = os.fork()
        if pid == 0:
            _rank(env, logs / f"rank-{rank}.log")
        pids[pid] = rank
    codes: list[int | None] = [None] * len(pids)
    deadline = time.monotonic() + float(request["timeout"])
    ending_at: float | None = None  # set once the gang is being ended: SIGKILL after the grace
    timed_out = False
    while any(c is None for c in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and ending_at is None:
                ending_at = _signal_all(pids, codes, signal.SIGTERM) + GRACE_S
            continue
        now = time.monotonic()
        if ending_at is None and now > deadline:
            timed_out = True
            ending_at = _signal_all(pids, codes, signal.SIGTERM) + GRACE_S
        elif ending_at is not None and now > ending_at:
            _signal_all(pids, codes, signal.SIGKILL)
        time.sleep(0.02)
    return {"id": request["id"], "codes": codes, "timed_out": timed_out}


def _signal_all(pids: dict[int, int], codes: list[int | None], sig: signal.Signals) -> float:
    for pid, rank in pids.items():
        if codes[rank] is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:  # not yet in a group of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    return time.monotonic()


def main() -> None:
    for module in PRELOADED:
        importlib.import_module(module)
    out = sys.stdout
    for line in sys.stdin:
        out.write(json.dumps(_gang(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
