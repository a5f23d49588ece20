"""One MLflow client of `benchmarks.ingest --vs-mlflow`, run by the python of the venv that the
benchmark makes (MLflow there, no torchyard): a run of its own, then `log_batch` calls of 1000
metrics (1000 // keys steps of `keys` scalars, as a rank logs them) for SECONDS.

    mlflow_client.py URL KEYS SECONDS

Prints "ready VERSION" once its run exists and one call has warmed the server worker it talks
to (a worker's first calls take seconds), and starts on a line from stdin, so none of that is in
the timed window; then prints the points of the timed calls, all of which returned."""

from __future__ import annotations

import sys
import time

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

url, keys, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
client = MlflowClient(url)
run_id = client.create_run("0").info.run_id  # "0": the default experiment of a fresh store
steps, step = 1000 // keys, 0


def log_batch() -> int:
    global step
    now = int(time.time() * 1000)
    # a metric row is unique by (key, step, timestamp, value): every point here is a new row
    batch = [Metric(f"k{k}", (step + i) * 0.5, now, step + i) for i in range(steps) for k in range(keys)]
    client.log_batch(run_id, metrics=batch)
    step += steps
    return len(batch)


log_batch()  # the warm-up (the benchmark counts the rows stored after "go" only)
print("ready", mlflow.__version__, flush=True)
sys.stdin.readline()
sent, end = 0, time.perf_counter() + seconds
while time.perf_counter() < end:
    sent += log_batch()
print(sent, flush=True)
