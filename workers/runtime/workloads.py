"""Built-in workloads: model, data set, loss and optimizer, with nothing to download.

- ``mlp``: synthetic classification; inputs from a seeded generator, labels from a fixed random
  "teacher" network, so the student's loss really falls;
- ``charlm``: a small causal transformer over bytes of the Python standard library's own sources;
- ``fail``: a tiny mlp that raises (or hangs, ``workers/runtime/hangs.py``, or runs ``slow_s`` slower
  per step from there on) at ``params.at_step`` (what a failing, hung or straggling run looks like).

A strategy (``workers.runtime.strategies``) wraps ``Workload.model`` and feeds it batches made
by ``Workload.dataset``: a map-style torch Dataset whose ``__getitems__`` returns a whole batch (a
tuple of tensors, first dimension = samples), so a DataLoader needs ``collate_fn=as_batch``.
Everything is built from ``training.seed`` alone: every rank builds the same model and data.

A run whose spec names a registered dataset (``data.dataset``) has no generated data set: the mlp
and charlm read its samples through ``torchyard.data`` and ``Workload.collate`` turns each list of
samples (raw field bytes) into their batch, plus the samples' global numbers last.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from torchyard.data import Sample
from torchyard.spec import FAIL_MLP, CharLMParams, FailParams, MlpParams, RunSpec
from workers.runtime import hangs

Batch = tuple[Tensor, ...]


def as_batch(batch: Any) -> Any:
    """DataLoader ``collate_fn`` for these data sets: ``__getitems__`` already made the batch."""
    return batch


class BatchDataset(Dataset[Batch]):
    """A map-style data set of known length whose ``__getitems__(indices)`` returns the batch."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Batch:
        raise NotImplementedError

    def __getitems__(self, indices: list[int]) -> Batch:
        raise NotImplementedError


class TensorBatches(BatchDataset):
    """Samples held as tensors; indexing a list of indices yields the whole batch at once."""

    def __init__(self, *tensors: Tensor) -> None:
        assert tensors and all(len(t) == len(tensors[0]) for t in tensors)
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> Batch:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[idx] for t in self.tensors)


class WindowBatches(BatchDataset):
    """Non-overlapping windows of a byte sequence: sample i is (x, y) = data[iL:iL+L], data[iL+1:iL+L+1]."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.count = (len(data) - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"corpus of {len(data)} bytes is shorter than one window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Batch:
        window = self.data[index * self.seq_len : index * self.seq_len + self.seq_len + 1]
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> Batch:
        starts = torch.as_tensor(indices, dtype=torch.long) * self.seq_len
        windows = self.data[starts[:, None] + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]


class LateBatches(BatchDataset):
    """Another data set whose batches come late: ``delay_s`` later each, or, once ``armed``, never
    (the ``fail`` workload's slow data source, and the one that stopped answering)."""

    def __init__(self, inner: BatchDataset) -> None:
        self.inner, self.armed, self.delay_s = inner, False, 0.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Batch:
        return self.inner[index]

    def __getitems__(self, indices: list[int]) -> Batch:
        while self.armed:
            time.sleep(1.0)
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner.__getitems__(indices)


@dataclass
class Workload:
    name: str
    model: nn.Module
    dataset: BatchDataset | None  # None: the run reads a registered dataset (``collate``)
    loss: Callable[[nn.Module, Batch], Tensor]  # (model, batch on the model's device) -> scalar loss
    make_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
    tokens_per_sample: int = 0  # > 0: the runtime also reports tokens_per_s
    before_step: Callable[[int], None] | None = None  # called with the step number (1-based)
    # (model output, target) -> loss; ``loss`` is criterion(model(x), y). Pipelines need it apart.
    criterion: Callable[[Tensor, Tensor], Tensor] | None = None
    # A registered dataset's samples (undecoded fields) -> (*batch, their global numbers).
    collate: Callable[[list[Sample]], Batch] | None = None


def _adam(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits, y)


def _classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return _cross_entropy(model(x), y)


def _mlp(input_dim: int, hidden: int, layers: int, classes: int) -> nn.Sequential:
    modules: list[nn.Module] = []
    width = input_dim
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, classes))
    return nn.Sequential(*modules)


def build_mlp(p: MlpParams, seed: int, name: str = "mlp", generate: bool = True) -> Workload:
    """``generate``: the synthetic data set (else the run reads a registered dataset)."""
    dataset = None
    if generate:
        gen = torch.Generator().manual_seed(seed)
        teacher = _mlp(p.input_dim, 64, 2, p.classes)
        with torch.no_grad():
            for param in teacher.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) / max(1, param.shape[-1]) ** 0.5)
            x = torch.randn(p.samples, p.input_dim, generator=gen)
            y = teacher(x).argmax(dim=1)
        dataset = TensorBatches(x, y)
    torch.manual_seed(seed)  # the student's initialisation: identical on every rank
    model = _mlp(p.input_dim, p.hidden, p.layers, p.classes)

    def collate(samples: list[Sample]) -> Batch:  # fields: input.npy, cls (backend/datasets.py checked)
        labels = [int(s["cls"]) for s in samples]
        for s, label in zip(samples, labels, strict=True):
            if not 0 <= label < p.classes:
                raise ValueError(
                    f"sample {s['__index__']} (shard {s['__shard__']}) has class {label}: workload.params.classes "
                    f"({p.classes}) allows 0..{p.classes - 1}"
                )
        x = torch.from_numpy(np.stack([_vector(s["input.npy"], p.input_dim) for s in samples]))
        return x, torch.tensor(labels), _numbers(samples)

    return Workload(name, model, dataset, _classification_loss, _adam, criterion=_cross_entropy, collate=collate)


def _vector(npy: bytes, dim: int) -> np.ndarray:
    """A .npy of ``dim`` float32 values. The api checked at submit that every sample's is just that
    (the dataset's schema): its values are its last 4 × dim bytes, read without parsing its header
    (np.load's header parsing was 60 % of the reading time). Anything else goes through np.load,
    which says what it is."""
    if npy.startswith(b"\x93NUMPY") and len(npy) >= 4 * dim + 10:
        return np.frombuffer(npy, dtype="<f4", count=dim, offset=len(npy) - 4 * dim)
    return np.load(io.BytesIO(npy), allow_pickle=False)


def _numbers(samples: list[Sample]) -> Tensor:
    return torch.tensor([s["__index__"] for s in samples], dtype=torch.long)


# -- charlm ------------------------------------------------------------------------------------


def stdlib_corpus(limit: int) -> bytes:
    """Up to ``limit`` bytes of the standard library's .py sources, in sorted path order (the
    top directory first, then subpackages; installed packages excluded)."""
    root = Path(os.__file__).parent
    chunks: list[bytes] = []
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            try:
                data = (Path(dirpath) / filename).read_bytes()
            except OSError:
                continue
            chunks.append(data[: limit - size])
            size += len(chunks[-1])
            if size >= limit:
                return b"".join(chunks)
    return b"".join(chunks)


class CharTransformer(nn.Module):
    """Byte-level causal transformer (pre-norm, no dropout: deterministic)."""

    def __init__(self, p: CharLMParams, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, p.d_model)
        self.pos = nn.Parameter(torch.randn(p.seq_len, p.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            p.d_model, p.n_heads, dim_feedforward=4 * p.d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, p.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _lm_criterion(logits: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return _lm_criterion(model(x), y)


def build_charlm(p: CharLMParams, seed: int, generate: bool = True) -> Workload:
    """``generate``: the stdlib corpus (else the run reads a registered dataset's ``txt`` fields)."""
    dataset = None
    if generate:
        corpus = stdlib_corpus(p.corpus_bytes)
        dataset = WindowBatches(torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long(), p.seq_len)
    torch.manual_seed(seed)
    model = CharTransformer(p)

    def collate(samples: list[Sample]) -> Batch:
        """A sample's first seq_len + 1 bytes are one window; a shorter one is padded, and its
        padded targets are ignored by the loss (cross-entropy's ignore_index, -100)."""
        x = torch.zeros(len(samples), p.seq_len, dtype=torch.long)
        y = torch.full((len(samples), p.seq_len), -100, dtype=torch.long)
        for i, s in enumerate(samples):
            window = torch.frombuffer(bytearray(s["txt"][: p.seq_len + 1]), dtype=torch.uint8).long()
            x[i, : max(0, len(window) - 1)] = window[:-1]
            y[i, : max(0, len(window) - 1)] = window[1:]
        return x, y, _numbers(samples)

    return Workload(
        "charlm",
        model,
        dataset,
        _lm_loss,
        _adam,
        tokens_per_sample=p.seq_len,
        criterion=_lm_criterion,
        collate=collate,
    )


# -- fail --------------------------------------------------------------------------------------


def build_fail(params: FailParams, seed: int) -> Workload:
    workload = build_mlp(FAIL_MLP, seed, name="fail")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # how often torch elastic restarted us
    fails_here = params.rank in (None, int(os.environ.get("RANK", "0"))) and (
        not params.times or restarts < params.times
    )
    if params.hang:  # how it hangs: workers/runtime/hangs.py
        if not fails_here:
            workload.before_step = hangs.others_at_step(params)
            return workload
        data = None
        if params.hang_in == "data_loading":
            assert workload.dataset is not None  # the spec refuses a registered dataset for 'fail'
            workload.dataset = data = LateBatches(workload.dataset)
            data.armed = params.at_step == 1
        workload.before_step = hangs.hang_at_step(params, data)
        return workload
    if params.slow_s:
        if fails_here:
            workload.before_step = _slow_from(params, workload)
        return workload

    def before_step(step: int) -> None:
        if step == params.at_step and fails_here:
            raise RuntimeError(f"workload 'fail' raised at step {params.at_step} (start {restarts + 1})")

    workload.before_step = before_step
    return workload


def _slow_from(params: FailParams, workload: Workload) -> Callable[[int], None]:
    """``params.slow_s`` more per step from ``at_step`` on, in the data loading or the compute. A
    sleep: the step takes as long as with slow data or compute, without loading the shared CPUs
    (a straggler among ranks that share a machine's cores would slow the others too)."""
    data = None
    if params.slow_in == "data_loading":
        assert workload.dataset is not None  # the spec refuses a registered dataset for 'fail'
        workload.dataset = data = LateBatches(workload.dataset)
        data.delay_s = params.slow_s if params.at_step == 1 else 0.0

    def before_step(step: int) -> None:  # after the step's batch is loaded, before its forward
        if data is not None:
            if step == params.at_step - 1:
                data.delay_s = params.slow_s  # from the next batch on, the one of at_step
        elif params.slow_in == "throttled":
            if step == params.at_step:
                _throttle()
        elif step >= params.at_step:
            time.sleep(params.slow_s)  # counted in compute_time_s: after data_ready, before the collectives

    return before_step


THROTTLE_SHARE = 0.05  # of a CPU the rank may use
THROTTLE_TICK_S = 0.0005  # how often its use is read: short against a step's compute, so the stops land in it


def _throttle() -> None:
    """This rank from now on runs as in a container at its CPU quota: CFS bandwidth control stops
    the process once it has used its share of a CPU, until its use is back to that share, while
    time spent waiting (in a collective) costs it nothing. A child does it, reading the training
    thread's CPU time (``/proc/<pid>/schedstat``) every tick and stopping the rank (SIGSTOP, then
    SIGCONT) for as long as its share asks: the rank is slower however loaded the host is (a nice
    level against a busy process, tried first, gave way under CI's load, where every process was
    slow). The child dies with the rank (PR_SET_PDEATHSIG) and, ended itself, lets the rank run on."""
    # It asks to be killed when the rank dies, then checks that the rank had not died already.
    limiter = (
        "import ctypes, os, signal, sys, time\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
        f"rank = {os.getpid()}\n"
        "if os.getppid() != rank: sys.exit()\n"
        "def leave(*_):\n    os.kill(rank, signal.SIGCONT)\n    sys.exit()\n"
        "signal.signal(signal.SIGTERM, leave)\n"
        "def used():\n"
        "    with open(f'/proc/{rank}/schedstat') as f:\n        return int(f.read().split()[0]) / 1e9\n"
        "print('holding', flush=True)\n"
        "last = used()\n"
        "while True:\n"
        f"    time.sleep({THROTTLE_TICK_S})\n"
        "    now = used()\n"
        f"    off = (now - last) / {THROTTLE_SHARE} - {THROTTLE_TICK_S}  # the wall time that brings it to its share\n"
        "    last = now\n"
        "    if off > 0:\n"
        "        os.kill(rank, signal.SIGSTOP)\n"
        "        time.sleep(off)\n"
        "        os.kill(rank, signal.SIGCONT)\n"
    )
    # From the next step on, not once its interpreter has started a few dozen steps later.
    holder = subprocess.Popen([sys.executable, "-c", limiter], stdout=subprocess.PIPE)
    assert holder.stdout is not None
    holder.stdout.readline()


def build(spec: RunSpec) -> Workload:
    w, seed, generate = spec.workload, spec.training.seed, spec.data is None
    if w.name == "mlp":
        return build_mlp(w.params, seed, generate=generate)
    if w.name == "charlm":
        return build_charlm(w.params, seed, generate=generate)
    if w.name == "fail":
        return build_fail(w.params, seed)
    raise ValueError(f"unknown built-in workload {w.name!r}")
