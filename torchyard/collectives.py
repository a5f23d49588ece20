"""Collective kinds and the ring's arithmetic, spelled once: the ranks time collectives by kind
(``workers/runtime/comm.py``: ``comm_bytes_<kind>``, busbw) and the scaling advisor
(``backend/advisor.py``) projects them to other world sizes with the same factors."""

from __future__ import annotations

from enum import StrEnum

KIND_BYTES = "comm_bytes_"  # comm_bytes_<kind>: a step's bytes of one collective kind (a metric key)


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"
    ALL_TO_ALL = "all_to_all"


def bus_factor(kind: str, world: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over ``world`` ranks: the share of the
    buffer each rank's link carries in a ring (all-reduce 2(n−1)/n; all-gather, reduce-scatter
    (n−1)/n; anything else 1)."""
    if world < 2:
        return 0.0
    if kind == Collective.ALL_REDUCE:
        return 2 * (world - 1) / world
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return (world - 1) / world
    return 1.0


def ring_hops(kind: str, world: int) -> int:
    """Steps of a ring collective over ``world`` ranks, each paying the link's latency once:
    all-reduce is a reduce-scatter then an all-gather (2(n−1)); all-gather, reduce-scatter and
    all-to-all n−1; broadcast and send/recv one (a pipelined chain, a single message)."""
    if world < 2:
        return 0
    if kind == Collective.ALL_REDUCE:
        return 2 * (world - 1)
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return world - 1
    return 1
