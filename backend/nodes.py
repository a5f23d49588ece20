"""Nodes and their capacity: heartbeats in Redis become rows. A CPU run takes CPU slots, a CUDA
run GPUs (one process per GPU; no slots); what is free is what the node offers minus what the
shares that still hold it took."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend import errors
from backend.models import Allocation, Attempt, Node, Run
from backend.schemas import GpuOut, NodeOut
from torchyard import streams
from torchyard.spec import ResourcesConfig
from torchyard.states import NodeState

# Why a run waits when no node can take it at all: said by the api at submit and by the scheduler.
NONE_REGISTERED = "no worker node has registered yet: the run starts when one does (`torchyard worker`)"
NONE_ALIVE = "no worker node is alive"


def sync_from_heartbeats(session: Session, client: redis.Redis) -> list[Node]:
    """Upserts every node that heartbeated; marks the silent ones lost. Returns the nodes that
    were just lost (their runs need attention)."""
    try:
        members: Any = client.smembers(streams.NODES)
    except redis.ResponseError:  # WRONGTYPE: not a set; the heartbeats make it again
        client.delete(streams.NODES)
        client.hincrby(streams.REJECTED, "nodes-not-a-set", 1)
        members = set()
    # Nodes the database knows but this Redis has never heard of (e.g. Redis was replaced) are
    # checked too: with no heartbeat key they are lost, not alive forever.
    known_alive = session.scalars(select(Node.id).where(Node.status == NodeState.ALIVE)).all()
    node_ids = sorted({m.decode() for m in members} | set(known_alive))
    beats = client.mget([streams.node_key(n) for n in node_ids]) if node_ids else []
    newly_lost = []
    for node_id, beat in zip(node_ids, beats, strict=True):
        node = session.get(Node, node_id)
        if beat is None:
            if node is not None and node.status == NodeState.ALIVE:
                node.status = NodeState.LOST
                newly_lost.append(node)
            continue
        info = _heartbeat(beat)
        if info is None:  # not a worker's heartbeat: never a node
            client.hincrby(streams.REJECTED, "heartbeat", 1)
            continue
        if node is None:
            node = Node(id=node_id, host=info["host"], slots=info["slots"])
            session.add(node)
        node.host, node.slots, node.devices = info["host"], info["slots"], ",".join(info["devices"])
        node.gpus = info.get("gpus", [])  # a worker from before GPUs were a resource lists none
        node.caps = info.get("caps", "")[:300]
        node.last_heartbeat = datetime.fromtimestamp(info["ts"], UTC)
        node.status = NodeState.ALIVE
    session.flush()
    return newly_lost


def _heartbeat(raw: Any) -> dict[str, Any] | None:
    """A heartbeat's fields if it is one a worker writes (``workers/node.py``), else None."""
    try:
        info = json.loads(raw)
        ok = (
            isinstance(info, dict)
            and isinstance(info.get("host"), str)
            and isinstance(info.get("slots"), int)
            and 1 <= info["slots"] <= 1_000_000
            and isinstance(info.get("devices"), list)
            and all(isinstance(d, str) for d in info["devices"])
            and isinstance(info.get("ts"), (int, float))
            and 0 <= info["ts"] < 1e11
            and _gpus_ok(info.get("gpus", []))
            and isinstance(info.get("caps", ""), str)
        )
    except (ValueError, TypeError):
        return None
    return info if ok else None


def _gpus_ok(gpus: Any) -> bool:
    """A heartbeat's GPU list as ``workers/gpus.py`` writes it: distinct indices, a model, a size."""
    return (
        isinstance(gpus, list)
        and len(gpus) <= 1024
        and all(
            isinstance(g, dict)
            and set(g) == {"index", "name", "memory_bytes"}
            and type(g["index"]) is int
            and 0 <= g["index"] < 1024
            and isinstance(g["name"], str)
            and len(g["name"]) <= 200
            and (g["memory_bytes"] is None or (type(g["memory_bytes"]) is int and 0 <= g["memory_bytes"] < 1 << 60))
            for g in gpus
        )
        and len({g["index"] for g in gpus}) == len(gpus)
    )


def offers(node: Node, device: str) -> bool:
    return device in node.devices.split(",")


def capacity(node: Node, device: str) -> int:
    """The most one run's share on ``device`` can have of this node: its GPUs for cuda (a process
    each), its CPU slots for cpu; 0 where it does not run ``device``."""
    if not offers(node, device):
        return 0
    return len(node.gpus) if device == "cuda" else node.slots


def unit(device: str) -> str:
    """What a share on ``device`` counts, for messages: "GPUs" or "slots"."""
    return "GPUs" if device == "cuda" else "slots"


@dataclass
class Free:
    """What an alive node has free now: CPU slots, and its GPUs that no share holds."""

    slots: int
    gpus: list[int]

    def count(self, device: str) -> int:
        return len(self.gpus) if device == "cuda" else self.slots


def active_allocations(session: Session) -> list[tuple[Allocation, Run]]:
    """Allocations whose node still runs its share: a node's slots stay held until its worker
    reports the share's exit (or the node is lost), even when the attempt already ended
    elsewhere in the gang, so a new run never lands on processes still winding down."""
    rows = session.execute(
        select(Allocation, Run)
        .join(Attempt, Allocation.attempt_id == Attempt.id)
        .join(Run, Attempt.run_id == Run.id)
        .where(Allocation.ended_at.is_(None))
    ).all()
    return [(a, r) for a, r in rows]


def free_capacity(session: Session) -> dict[str, Free]:
    """What every alive node has free."""
    alive = session.scalars(select(Node).where(Node.status == NodeState.ALIVE))
    free = {n.id: Free(n.slots, [int(g["index"]) for g in n.gpus]) for n in alive}
    for alloc, _run in active_allocations(session):
        if alloc.node_id in free:
            node = free[alloc.node_id]
            node.slots -= alloc.slots
            node.gpus = [g for g in node.gpus if g not in alloc.gpus]
    return free


def free_slots(session: Session) -> dict[str, int]:
    """Free CPU slots of every alive node."""
    return {node_id: free.slots for node_id, free in free_capacity(session).items()}


def describe(session: Session) -> list[NodeOut]:
    running: dict[str, list[int]] = {}
    used: dict[str, int] = {}
    holder: dict[tuple[str, int], int] = {}  # (node, GPU index) -> the run holding it
    for alloc, run in active_allocations(session):
        running.setdefault(alloc.node_id, []).append(run.id)
        used[alloc.node_id] = used.get(alloc.node_id, 0) + alloc.slots
        holder.update({(alloc.node_id, g): run.id for g in alloc.gpus})
    out = []
    for n in session.scalars(select(Node).order_by(Node.id)):
        alive = n.status == NodeState.ALIVE
        gpus = [GpuOut(**g, run_id=holder.get((n.id, g["index"]))) for g in n.gpus]
        out.append(
            NodeOut(
                id=n.id,
                host=n.host,
                slots=n.slots,
                free_slots=max(0, n.slots - used.get(n.id, 0)) if alive else 0,
                devices=n.devices.split(","),
                gpus=gpus,
                free_gpus=sum(1 for g in gpus if g.run_id is None) if alive else 0,
                status=n.status,
                last_heartbeat=n.last_heartbeat,
                running_runs=sorted(running.get(n.id, [])),
                caps=n.caps,
            )
        )
    return out


def check_can_hold(session: Session, res: ResourcesConfig, allow_waiting: bool) -> list[str]:
    """A run that no registered node set can ever hold is a 422 naming the field and the largest
    node, unless the cluster may grow (TORCHYARD_ALLOW_WAITING_FOR_NODES): then it waits, and the
    returned warning says why. Lost nodes count (they may come back). With no node registered at
    all, every run waits for the first one."""
    registered = session.scalars(select(Node).order_by(Node.id)).all()
    if not registered:
        return [NONE_REGISTERED]
    problem = _never_fits(registered, res)
    if problem is None:
        return []
    field, message = problem
    if not allow_waiting:
        raise errors.InvalidRequest(["body", "resources", field], message, getattr(res, field))
    return [f"{message}; it waits for such nodes to join (TORCHYARD_ALLOW_WAITING_FOR_NODES)"]


def _never_fits(registered: Sequence[Node], res: ResourcesConfig) -> tuple[str, str] | None:
    """(field, why) when no set of the registered nodes can hold the run's gang, else None."""
    device, need, count = res.device, res.procs_per_node, res.nodes
    offering = [n for n in registered if offers(n, device)]
    if not offering:
        known = ", ".join(f"{n.id} ({n.devices})" for n in registered)
        return "device", f"resources.device ({device!r}): no node in the cluster has device {device!r}: {known}"
    units = unit(device)
    largest = max(offering, key=lambda n: capacity(n, device))
    if need > capacity(largest, device):
        per = " (one process per GPU)" if device == "cuda" else ""
        return "procs_per_node", (
            f"resources.procs_per_node ({need}){per}: the largest node, {largest.id}, has "
            f"{capacity(largest, device)} {units}"
        )
    big = [n.id for n in offering if capacity(n, device) >= need]
    if len(big) < count:
        return "nodes", (
            f"resources.nodes ({count}) × procs_per_node ({need}): only {len(big)} node(s) have {need} {units}: "
            + ", ".join(big)
        )
    return None
