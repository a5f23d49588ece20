"""The scaling advisor: from one finished run, how fast would it be on N ranks? Pure functions; what
a run measured is read by ``backend/scaling.py``, served by ``GET /runs/{id}/projection``.

Weak scaling: each rank keeps its batch, so a step's compute and data time stay as measured and
only communication and memory change with N. A step is data + compute + exposed comm, where:

- **comm per collective** is the ring's (the Hockney model): ``hops(N)·α + bytes·factor(N)/β``,
  the latency α per hop and the bus bandwidth β fitted to the run's own calibration (all-reduce at
  4 KB … 32 MB on its world group); hops and factors are ``torchyard/collectives.py``'s (all-reduce
  2(N−1) hops moving 2(N−1)/N of the buffer per link; all-gather, reduce-scatter N−1 and (N−1)/N).
  Bytes per collective stay as measured: DDP all-reduces the whole gradient and FSDP gathers and
  reduce-scatters whole layers at any N (nccl-tests' convention, which ``comm_bytes_<kind>`` follows);
- the run's collectives reached a share of that model's speed (``efficiency``: the modelled comm
  time at the measured world over the measured one: waiting for peers, hook overhead, a busy CPU);
  they keep that share at every N;
- **hidden comm**: what the run hid behind compute (DDP's all-reduce under backward; ``comm_time_s −
  exposed_comm_s``) stays hidden while it fits in that window; the rest is exposed;
- **CPU cores**: ranks beyond a node's cores share them, so compute, data loading, the hidden window
  and the bandwidth part slow by ranks per node / cores (relative to the measured run's own ratio);
- **memory** per rank: whole under DDP; under FSDP parameters, gradients (the parameters' size) and
  optimizer state split over N, the rest of the peak (activations, a gathered layer, the runtime) kept.

Projected: DDP and FSDP; every other strategy is excluded with the reason (``NOT_PROJECTED``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torchyard.collectives import Collective, bus_factor, ring_hops
from torchyard.units import fmt_bytes

PROJECTED = ("ddp", "fsdp")
NOT_PROJECTED = {
    "zero": "ZeRO broadcasts each parameter from its owner rank after the step: no ring collective this model covers",
    "local_sgd": "local SGD averages every `period` steps: its comm per step depends on the period, not modelled",
    "pipeline": "a pipeline's stages are its ranks: more ranks cut the model finer (not weak scaling) and its "
    "bubble depends on the microbatches",
    "tp": "tensor parallelism's comm follows the activations and the TP degree, inside forward and backward: "
    "not modelled",
    "fsdp_tp": "a 2-D mesh's comm follows the TP degree's activations as well as FSDP's layers: not modelled",
    "async": "a parameter server sends and receives every worker's gradient and parameters: the server's link "
    "bounds it, not a ring (not modelled)",
}
DEFAULT_RANKS = (1, 2, 4, 8, 16, 32, 64)
MAX_RANKS = 4096  # a world beyond this is no projection anyone can check
MAX_POINTS = 128  # ranks one projection answers


@dataclass(frozen=True, slots=True)
class Measured:
    """What one run measured, per step: medians over its steady steps (a step's time: its slowest
    rank's; its parts and bytes: the mean over ranks), and its rank 0's facts."""

    strategy: str  # ddp | fsdp
    world: int
    nodes: int
    ranks_per_node: int
    cpu_cores: int
    device: str  # cpu | cuda
    per_rank_batch: int
    step_time_s: float
    data_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    bytes_per_step: dict[str, float]  # kind → bytes one step issued (nccl-tests' convention)
    ops_per_step: dict[str, int]  # kind → collectives one step issued
    calibration: dict[int, float]  # bytes → all-reduce busbw (GB/s) on the world group
    peak_bytes: float  # the highest peak memory of any rank (CPU: max RSS; CUDA: max allocated)
    param_bytes: float  # parameters one rank holds (FSDP: its shard)
    optimizer_state_bytes: float  # optimizer state one rank holds
    steps: int = 0  # the steps the medians are over

    @property
    def compute_time_s(self) -> float:
        """The rest of the step: forward, backward, optimizer and all else but data and exposed comm."""
        return max(0.0, self.step_time_s - self.data_time_s - self.exposed_comm_s)

    @property
    def hidden_comm_s(self) -> float:
        return max(0.0, self.comm_time_s - self.exposed_comm_s)

    @property
    def samples_per_s(self) -> float:
        return self.per_rank_batch * self.world / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def state_bytes(self) -> float:
        """Parameters, their gradients (assumed the same size) and optimizer state one rank holds."""
        return 2 * self.param_bytes + self.optimizer_state_bytes


@dataclass(frozen=True, slots=True)
class Link:
    """A ring's link, fitted to a calibration: latency per hop and bus bandwidth."""

    latency_s: float
    busbw_GBps: float  # math.inf: the calibration showed no bandwidth limit (latency alone)

    def seconds(self, kind: str, nbytes: float, world: int) -> tuple[float, float]:
        """(latency part, bandwidth part) of one collective of ``nbytes`` over ``world`` ranks."""
        bandwidth = nbytes * bus_factor(kind, world) / (self.busbw_GBps * 1e9) if world > 1 else 0.0
        return ring_hops(kind, world) * self.latency_s, bandwidth


@dataclass(frozen=True, slots=True)
class ProjectionPoint:
    ranks: int
    nodes: int
    ranks_per_node: int
    step_time_s: float
    data_time_s: float
    compute_time_s: float
    comm_time_s: float  # latency + bandwidth parts, at the run's efficiency
    latency_s: float  # of comm_time_s
    exposed_comm_s: float
    samples_per_s: float
    efficiency: float  # the step time at 1 rank over this one (weak scaling: 1 is perfect)
    state_bytes: float  # parameters, gradients and optimizer state per rank
    peak_bytes: float  # peak memory per rank: CPU max RSS, CUDA max allocated


@dataclass(frozen=True, slots=True)
class Projection:
    strategy: str
    link: Link
    comm_efficiency: float  # the run's comm speed as a share of the fitted link's
    points: list[ProjectionPoint]
    assumptions: list[str]
    excluded: dict[str, str] = field(default_factory=dict)


def fit_link(calibration: dict[int, float], world: int) -> Link:
    """α and β of ``t(S) = hops·α + S·factor/β`` for the calibration's all-reduces (busbw per
    size, measured over ``world`` ranks), least squares in relative error (4 KB and 32 MB count
    alike), neither negative."""
    hops, factor = ring_hops(Collective.ALL_REDUCE, world), bus_factor(Collective.ALL_REDUCE, world)
    rows = []
    for size, busbw in sorted(calibration.items()):
        if size > 0 and busbw > 0:
            seconds = size * factor / (busbw * 1e9)  # busbw = algbw × factor
            rows.append((hops / seconds, size * factor / seconds))  # · (α, 1/β) ≈ 1
    if not rows or hops == 0:
        raise ValueError("the calibration has no measured size: nothing to fit a link to")
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, inverse_beta = -1.0, -1.0  # a single size (or sizes in one ratio) cannot fit both
    if det > 1e-12 * saa * sbb:
        alpha, inverse_beta = (sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det
    if alpha < 0 or inverse_beta < 0:  # the best fit with one of them 0 (or a single size)
        by_bandwidth, by_latency = (0.0, sb / sbb), (sa / saa, 0.0)
        alpha, inverse_beta = min(by_bandwidth, by_latency, key=lambda x: _residual(rows, *x))
    return Link(latency_s=alpha, busbw_GBps=1 / inverse_beta / 1e9 if inverse_beta > 0 else math.inf)


def _residual(rows: list[tuple[float, float]], alpha: float, inverse_beta: float) -> float:
    return sum((a * alpha + b * inverse_beta - 1) ** 2 for a, b in rows)


def comm_model(m: Measured, link: Link, world: int, slowdown: float = 1.0) -> tuple[float, float]:
    """(latency part, bandwidth part) of one step's collectives at ``world`` ranks, the bandwidth
    part ``slowdown`` times slower (ranks sharing cores)."""
    latency = bandwidth = 0.0
    for kind, nbytes in m.bytes_per_step.items():
        if nbytes <= 0:
            continue
        ops = max(1, m.ops_per_step.get(kind, 1))
        lat, bw = link.seconds(kind, nbytes / ops, world)
        latency, bandwidth = latency + ops * lat, bandwidth + ops * bw
    return latency, bandwidth * slowdown


def core_share(device: str, ranks_on_node: int, cores: int) -> float:
    """How much slower a rank's CPU work runs with ``ranks_on_node`` ranks on ``cores`` cores (1
    while each has a core of its own; a GPU rank's compute is its GPU's)."""
    return max(1.0, ranks_on_node / cores) if device == "cpu" else 1.0


def check_ranks(ranks: list[int], ranks_per_node: int) -> None:
    """ValueError naming what is wrong with the asked world sizes."""
    if not ranks:
        raise ValueError("ranks: give at least one world size, e.g. 1,2,4,8")
    if len(ranks) > MAX_POINTS:
        raise ValueError(f"ranks: {len(ranks)} world sizes, at most {MAX_POINTS}")
    bad = [n for n in ranks if not 1 <= n <= MAX_RANKS]
    if bad:
        raise ValueError(f"ranks ({', '.join(map(str, bad[:5]))}) must be between 1 and {MAX_RANKS}")
    if not 1 <= ranks_per_node <= MAX_RANKS:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must be between 1 and {MAX_RANKS}")


def project(
    m: Measured, ranks: list[int], ranks_per_node: int | None = None, cores_per_node: int | None = None
) -> Projection:
    """Step time, samples/s, scaling efficiency and memory per rank of ``m``'s run at each world size
    of ``ranks``, placed ``ranks_per_node`` to a node (default: as measured) of ``cores_per_node``
    CPU cores (default: the measured node's). ValueError for a world size out of range."""
    if m.strategy not in PROJECTED:
        raise ValueError(f"strategy {m.strategy!r}: {NOT_PROJECTED.get(m.strategy, 'not modelled')}")
    per_node = ranks_per_node or m.ranks_per_node
    cores = cores_per_node or m.cpu_cores
    check_ranks(ranks, per_node)
    link = fit_link(m.calibration, m.world)
    measured_share = core_share(m.device, min(m.world, m.ranks_per_node), m.cpu_cores)
    latency0, bandwidth0 = comm_model(m, link, m.world)
    modelled0 = latency0 + bandwidth0
    efficiency = modelled0 / m.comm_time_s if m.comm_time_s > 0 and modelled0 > 0 else 1.0

    def at(n: int) -> ProjectionPoint:
        slow = core_share(m.device, min(n, per_node), cores) / measured_share
        latency, bandwidth = comm_model(m, link, n, slow)
        comm = (latency + bandwidth) / efficiency
        hidden_window = m.hidden_comm_s * slow
        exposed = max(0.0, comm - hidden_window) if n > 1 else 0.0
        data, compute = m.data_time_s * slow, m.compute_time_s * slow
        step = data + compute + exposed
        state = m.state_bytes * m.world / n if m.strategy == "fsdp" else m.state_bytes
        return ProjectionPoint(
            ranks=n,
            nodes=math.ceil(n / per_node),
            ranks_per_node=min(n, per_node),
            step_time_s=step,
            data_time_s=data,
            compute_time_s=compute,
            comm_time_s=comm if n > 1 else 0.0,
            latency_s=latency / efficiency if n > 1 else 0.0,
            exposed_comm_s=exposed,
            samples_per_s=m.per_rank_batch * n / step if step > 0 else 0.0,
            efficiency=0.0,  # below, once the 1-rank step is known
            state_bytes=state,
            peak_bytes=max(0.0, m.peak_bytes - m.state_bytes) + state,
        )

    one = at(1).step_time_s
    points = [_with_efficiency(at(n), one) for n in sorted(set(ranks))]
    excluded = dict(NOT_PROJECTED)
    other = "fsdp" if m.strategy == "ddp" else "ddp"
    excluded[other] = (
        f"not measured: project it from a {other} run of the same workload (its collectives per step are "
        f"not known from a {m.strategy} run's)"
    )
    return Projection(
        m.strategy, link, efficiency, points, assumptions(m, link, efficiency, per_node, cores, ranks), excluded
    )


def _with_efficiency(p: ProjectionPoint, one_rank_step: float) -> ProjectionPoint:
    return replace(p, efficiency=one_rank_step / p.step_time_s if p.step_time_s > 0 else 0.0)


def assumptions(m: Measured, link: Link, efficiency: float, per_node: int, cores: int, ranks: list[int]) -> list[str]:
    """What the projection takes for granted, in the run's own figures."""
    ms = _ms
    collectives = ", ".join(
        f"{m.ops_per_step.get(kind, 1)} × {kind} ({fmt_bytes(nbytes / max(1, m.ops_per_step.get(kind, 1)))} each)"
        for kind, nbytes in m.bytes_per_step.items()
        if nbytes > 0
    )
    sizes = ", ".join(f"{fmt_bytes(size)} {bw:.2f}" for size, bw in m.calibration.items())
    bandwidth = "no limit seen" if math.isinf(link.busbw_GBps) else f"{link.busbw_GBps:.2f} GB/s"
    out = [
        f"weak scaling: every rank keeps its batch of {m.per_rank_batch} (the global batch grows with the ranks); "
        f"compute {ms(m.compute_time_s)} and data {ms(m.data_time_s)} per step as measured at {m.world} ranks "
        f"(medians of {m.steps} steady steps)",
        f"collectives per step as measured: {collectives or 'none'}; the bytes stay the same at any world size "
        + (
            "(DDP all-reduces the whole gradient)"
            if m.strategy == "ddp"
            else "(FSDP all-gathers and reduce-scatters whole layers)"
        ),
        f"a ring of links with {link.latency_s * 1e6:.0f} µs latency per hop and {bandwidth} bus bandwidth, fitted "
        f"to the run's all-reduce calibration at {m.world} ranks (busbw GB/s: {sizes}); all-reduce takes 2(N−1) "
        "hops and moves 2(N−1)/N of its buffer over each link, all-gather and reduce-scatter N−1 and (N−1)/N",
        f"the run's collectives took {ms(m.comm_time_s)} per step where the fitted link needs "
        f"{ms(m.comm_time_s * efficiency)} ({efficiency:.0%} of its speed: waits for peers, hooks, a busy CPU); "
        "they keep that share at every N",
        f"comm the run hid behind compute ({ms(m.hidden_comm_s)} per step: "
        + ("DDP's all-reduce under backward" if m.strategy == "ddp" else "FSDP's prefetched collectives")
        + ") stays hidden while it fits; the rest is exposed",
    ]
    if m.device == "cpu":
        out.append(
            f"ranks share a node's CPU cores ({cores} a node, {per_node} ranks a node): past one rank a core, "
            "compute, data loading, the hidden window and the bandwidth part slow by ranks / cores "
            f"(the measured run: {min(m.world, m.ranks_per_node)} ranks on {m.cpu_cores} cores)"
        )
    else:
        out.append("one rank a GPU: compute does not depend on the number of ranks")
    if any(n > per_node for n in ranks):
        out.append(
            f"links between nodes as fast as the calibration's (it ran across {m.nodes} nodes)"
            if m.nodes > 1
            else "links between nodes as fast as the calibrated ones within a node (the run did not cross "
            "nodes: a run that spans two nodes calibrates the real ones)"
        )
    if m.strategy == "ddp":
        out.append(f"memory per rank as measured: every rank holds the whole model, its gradients and optimizer "
                   f"state ({fmt_bytes(m.state_bytes)}); peak {fmt_bytes(m.peak_bytes)}")  # fmt: skip
    else:
        out.append(
            f"memory per rank: parameters, gradients (the parameters' size) and optimizer state "
            f"({fmt_bytes(m.state_bytes)} a rank at {m.world} ranks) split over N; the rest of the peak "
            f"({fmt_bytes(max(0.0, m.peak_bytes - m.state_bytes))}: activations, a gathered layer, the runtime) stays"
        )
    out.append("not modelled: links shared between rings, stragglers beyond the measured ones, a larger global "
               "batch's effect on convergence")  # fmt: skip
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
