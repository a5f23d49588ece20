"""Nodes and their capacity: heartbeats in Redis become rows; free slots are what the node
offers minus the allocations of attempts that still hold it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.models import Allocation, Attempt, Node, Run
from backend.schemas import NodeOut
from torchyard import streams


def sync_from_heartbeats(session: Session, client: redis.Redis) -> list[Node]:
    """Upserts every node that heartbeated; marks the silent ones lost. Returns the nodes that
    were just lost (their runs need attention)."""
    members: Any = client.smembers(streams.NODES)
    # Nodes the database knows but this Redis has never heard of (e.g. Redis was replaced) are
    # checked too: with no heartbeat key they are lost, not alive forever.
    known_alive = session.scalars(select(Node.id).where(Node.status == "alive")).all()
    node_ids = sorted({m.decode() for m in members} | set(known_alive))
    beats = client.mget([streams.node_key(n) for n in node_ids]) if node_ids else []
    newly_lost = []
    for node_id, beat in zip(node_ids, beats, strict=True):
        node = session.get(Node, node_id)
        if beat is None:
            if node is not None and node.status == "alive":
                node.status = "lost"
                newly_lost.append(node)
            continue
        info = json.loads(beat)
        if node is None:
            node = Node(id=node_id, host=info["host"], slots=info["slots"])
            session.add(node)
        node.host, node.slots, node.devices = info["host"], info["slots"], ",".join(info["devices"])
        node.last_heartbeat = datetime.fromtimestamp(info["ts"], UTC)
        node.status = "alive"
    session.flush()
    return newly_lost


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


def free_slots(session: Session) -> dict[str, int]:
    """Free slots of every alive node."""
    free = {n.id: n.slots for n in session.scalars(select(Node).where(Node.status == "alive"))}
    for alloc, _run in active_allocations(session):
        if alloc.node_id in free:
            free[alloc.node_id] -= alloc.slots
    return free


def describe(session: Session) -> list[NodeOut]:
    running: dict[str, list[int]] = {}
    used: dict[str, int] = {}
    for alloc, run in active_allocations(session):
        running.setdefault(alloc.node_id, []).append(run.id)
        used[alloc.node_id] = used.get(alloc.node_id, 0) + alloc.slots
    return [
        NodeOut(
            id=n.id,
            host=n.host,
            slots=n.slots,
            free_slots=max(0, n.slots - used.get(n.id, 0)) if n.status == "alive" else 0,
            devices=n.devices.split(","),
            status=n.status,
            last_heartbeat=n.last_heartbeat,
            running_runs=sorted(running.get(n.id, [])),
        )
        for n in session.scalars(select(Node).order_by(Node.id))
    ]
