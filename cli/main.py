"""The ``torchyard`` command: start the system's processes, and talk to its api. The commands live
by concept (``processes``, ``runs``, ``datasets``, ``tokens``, ``sweeps``); this root group only
gathers them, so ``python -m cli.main`` and the console script see one command tree."""

from __future__ import annotations

import click

from cli import datasets, processes, runs, sweeps, tokens


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """torchyard: run and watch distributed PyTorch training."""


for command in (
    processes.up, processes.url, processes.api, processes.scheduler, processes.ingest, processes.worker,
    processes.migrate,
    runs.submit, runs.submit_script, runs.runs, runs.logs, runs.compare_strategies, runs.cancel, runs.project,
    runs.checkpoints,
    datasets.dataset, tokens.token, sweeps.sweep,
):  # fmt: skip
    main.add_command(command)


if __name__ == "__main__":
    main()
