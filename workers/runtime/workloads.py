"""Built-in workloads: model, data set, loss and optimizer, with nothing to download.

- ``mlp``: synthetic classification; inputs from a seeded generator, labels from a fixed random
  "teacher" network, so the student's loss really falls;
- ``charlm``: a small causal transformer over bytes of the Python standard library's own sources;
- ``fail``: a tiny mlp that raises (or hangs) at ``params.at_step`` (what a failing or hung run looks like).

A strategy (``workers.runtime.strategies``) wraps ``Workload.model`` and feeds it batches made
by ``Workload.dataset``: a map-style torch Dataset whose ``__getitems__`` returns a whole batch (a
tuple of tensors, first dimension = samples), so a DataLoader needs ``collate_fn=as_batch``.
Everything is built from ``training.seed`` alone: every rank builds the same model and data.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from torchyard.spec import CharLMParams, FailParams, MlpParams, RunSpec

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


@dataclass
class Workload:
    name: str
    model: nn.Module
    dataset: BatchDataset
    loss: Callable[[nn.Module, Batch], Tensor]  # (model, batch on the model's device) -> scalar loss
    make_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
    tokens_per_sample: int = 0  # > 0: the runtime also reports tokens_per_s
    before_step: Callable[[int], None] | None = None  # called with the step number (1-based)
    # (model output, target) -> loss; ``loss`` is criterion(model(x), y). Pipelines need it apart.
    criterion: Callable[[Tensor, Tensor], Tensor] | None = None


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


def build_mlp(p: MlpParams, seed: int, name: str = "mlp") -> Workload:
    gen = torch.Generator().manual_seed(seed)
    teacher = _mlp(p.input_dim, 64, 2, p.classes)
    with torch.no_grad():
        for param in teacher.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / max(1, param.shape[-1]) ** 0.5)
        x = torch.randn(p.samples, p.input_dim, generator=gen)
        y = teacher(x).argmax(dim=1)
    torch.manual_seed(seed)  # the student's initialisation: identical on every rank
    model = _mlp(p.input_dim, p.hidden, p.layers, p.classes)
    return Workload(name, model, TensorBatches(x, y), _classification_loss, _adam, criterion=_cross_entropy)


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


def build_charlm(p: CharLMParams, seed: int) -> Workload:
    corpus = stdlib_corpus(p.corpus_bytes)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    torch.manual_seed(seed)
    model = CharTransformer(p)
    return Workload(
        "charlm",
        model,
        WindowBatches(data, p.seq_len),
        _lm_loss,
        _adam,
        tokens_per_sample=p.seq_len,
        criterion=_lm_criterion,
    )


# -- fail --------------------------------------------------------------------------------------


def build_fail(params: FailParams, seed: int) -> Workload:
    workload = build_mlp(MlpParams.model_validate({"hidden": 16, "layers": 1, "samples": 1024}), seed, name="fail")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # how often torch elastic restarted us
    fails_here = params.rank in (None, int(os.environ.get("RANK", "0"))) and (
        not params.times or restarts < params.times
    )

    def before_step(step: int) -> None:
        if step != params.at_step or not fails_here:
            return
        if params.hang:
            threading.Event().wait()  # a deadlock, as a stuck collective looks from outside
        raise RuntimeError(f"workload 'fail' raised at step {params.at_step} (start {restarts + 1})")

    workload.before_step = before_step
    return workload


def build(spec: RunSpec) -> Workload:
    w, seed = spec.workload, spec.training.seed
    if w.name == "mlp":
        return build_mlp(w.params, seed)
    if w.name == "charlm":
        return build_charlm(w.params, seed)
    if w.name == "fail":
        return build_fail(w.params, seed)
    raise ValueError(f"unknown built-in workload {w.name!r}")
