"""Why a run is stuck, from its ranks' hang dumps (``torchyard/hangdump.py``): a pure comparison
across ranks, no database and no I/O.

Per process group it takes each rank's last collective entered and completed (torch's Flight
Recorder: sequence number, op, sizes, state) and finds

- a **mismatch**: ranks that made different collectives under one sequence number ("rank 0 in
  all_reduce #412, rank 1 in broadcast #412"), or the same op with other sizes;
- the ranks that **never entered** the collective others wait in ("rank 1 never entered all_reduce
  #412 that ranks 0, 2, 3 wait in"), with where the missing rank is instead (waiting in another
  collective, or in Python: its innermost frames);
- a collective every rank entered and none left (the transport, or a peer gone);
- no collective in flight at all: the ranks are stuck in Python.

Findings are ordered by what most likely came first: mismatches, then "never entered" with the
fewest missing ranks (the one rank that left the others, not the many it left), then the longest
wait. The dumps come from the ranks' own code: every field is read defensively, and anything
malformed counts as absent, never as an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchyard import hangdump

# Ops whose buffers have one size on every rank; others (all_to_all with splits, send/recv) may differ.
SAME_SIZES = {"all_reduce", "allreduce", "broadcast", "reduce", "all_gather", "allgather", "_allgather_base",
              "all_gather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base", "barrier"}  # fmt: skip
USER_FRAMES = 5  # innermost frames of the run's own code shown per stuck rank
CUDA = " cuda"  # the key suffix of an NCCL group whose name Gloo's recorder also uses (one group, two backends)


@dataclass
class Call:
    """One collective as one rank's recorder saw it."""

    group: str
    seq: int
    op: str
    sizes: list[Any]
    dtypes: list[Any]
    done: bool
    created_ns: int
    thread: int | None

    def label(self, groups: dict[str, str]) -> str:
        return f"{self.op} #{self.seq}{groups.get(self.group, f' (group {self.group})')}"


@dataclass
class Rank:
    rank: int
    time: float
    calls: dict[str, dict[int, Call]] = field(default_factory=dict)  # group → seq → call
    entered: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    threads: list[dict[str, Any]] = field(default_factory=list)
    recorder_error: str = ""

    def pending(self, group: str) -> list[Call]:
        done = self.completed.get(group, 0)
        return sorted((c for s, c in self.calls.get(group, {}).items() if s > done and not c.done), key=lambda c: c.seq)

    def waiting_in(self) -> Call | None:
        """The collective this rank waits in: its oldest pending one, whatever the group."""
        calls = [p for g in self.calls for p in self.pending(g)[:1]]
        return min(calls, key=lambda c: c.created_ns) if calls else None


def analyze(dumps: list[Any], world: int, missing: dict[str, str] | None = None) -> dict[str, Any]:
    """The diagnosis: ``headline``, ``findings`` (each ``kind``, ``text``, the ranks to blame and the
    ones waiting), ``ranks`` (each rank's state, what it waits in, its innermost frames) and
    ``groups`` (each group's last collective per rank). ``missing``: why ranks did not answer."""
    ranks: dict[int, Rank] = {}
    for dump in dumps:
        parsed = _parse(dump, world)
        if parsed is not None and parsed.rank not in ranks:
            ranks[parsed.rank] = parsed
    members, labels = _groups(dumps, ranks, world)
    findings = []
    for group in sorted(members, key=_group_order):
        findings += _group_findings(group, members[group], ranks, labels)
    silent = [r for r in range(world) if r not in ranks]
    findings.sort(key=_finding_order)
    if not any(f["kind"] != "mismatch_done" for f in findings):  # a past mismatch comes after what the ranks do now
        findings = _no_collective_in_flight(ranks) + findings
    if silent:
        reasons = sorted(set((missing or {}).values())) or ["no dump came"]
        findings.append({"kind": "silent", "ranks": silent, "waiting": [],
                         "text": f"{_ranks(silent)} did not answer: {'; '.join(reasons)}"})  # fmt: skip
    for f in findings:
        if f["kind"] == "never_entered":
            f["text"] += _elsewhere(f["ranks"], ranks, labels)
    return {
        "headline": findings[0]["text"] if findings else "no dump to compare",
        "findings": findings,
        "ranks": [_rank_state(ranks.get(r), r, labels) for r in range(world)],
        "groups": [_group_table(g, members[g], ranks, labels) for g in sorted(members, key=_group_order)],
        "answered": len(ranks),
        "world": world,
    }


def _parse(dump: Any, world: int) -> Rank | None:
    if not isinstance(dump, dict):
        return None
    rank = _int(dump.get("rank"), -1)
    if not 0 <= rank < world:
        return None
    out = Rank(rank, _float(dump.get("time")), threads=[t for t in _list(dump.get("threads")) if isinstance(t, dict)])
    recorder, cuda = dump.get("flight_recorder"), dump.get("flight_recorder_cuda")
    if dump.get("fr_buffer_size") == 0:
        out.recorder_error = "the Flight Recorder is off (TORCHYARD_FR_BUFFER_ENTRIES=0)"
        return out
    if not isinstance(recorder, dict) and not isinstance(cuda, dict):
        out.recorder_error = "no process group yet" if recorder is None else "malformed"
        return out
    taken = _read(out, recorder, "") if isinstance(recorder, dict) else set()
    if isinstance(cuda, dict):
        calls = Rank(rank, out.time)
        if _read(calls, cuda, "") & taken:  # CUDA builds record NCCL apart: keep one group's two backends apart
            calls = Rank(rank, out.time)
            _read(calls, cuda, CUDA)
        out.calls.update(calls.calls)
        out.entered.update(calls.entered)
        out.completed.update(calls.completed)
        out.recorder_error = out.recorder_error or calls.recorder_error
    return out


def _read(out: Rank, recorder: dict[str, Any], suffix: str) -> set[str]:
    """One recorder's collectives into ``out``, its groups keyed by name + ``suffix``; returns the keys."""
    out.recorder_error = str(recorder.get("error") or "")[:300]
    names: dict[str, str] = {}  # pg_id → group name, as this rank's entries say
    for e in _list(recorder.get("entries"))[-hangdump.MAX_ENTRIES :]:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue  # send/recv pair off one to one: no group-wide sequence to compare
        pg = _list(e.get("process_group"))
        group = (str(pg[0]) if pg else str(e.get("pg_id"))) + suffix
        names[str(e.get("pg_id"))] = group
        call = Call(
            group,
            _int(e.get("collective_seq_id"), 0),
            str(e.get("profiling_name") or "?").split(":")[-1][:60],
            _list(e.get("input_sizes")),
            _list(e.get("input_dtypes")),
            e.get("retired") is True or e.get("state") == "completed",
            _int(e.get("time_created_ns"), 0),
            _int(e.get("thread_id"), 0) or None,
        )
        out.calls.setdefault(group, {})[call.seq] = call
        out.entered[group] = max(out.entered.get(group, 0), call.seq)
        if call.done:
            out.completed[group] = max(out.completed.get(group, 0), call.seq)
    status = recorder.get("pg_status")
    for pg_id, st in status.items() if isinstance(status, dict) else []:
        if isinstance(st, dict):
            group = names.get(str(pg_id), str(pg_id) + suffix)
            out.entered[group] = max(out.entered.get(group, 0), _int(st.get("last_enqueued_collective"), 0))
            out.completed[group] = max(out.completed.get(group, 0), _int(st.get("last_completed_collective"), 0))
    return set(out.entered)


def _groups(dumps: list[Any], ranks: dict[int, Rank], world: int) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each group's members (as the ranks said; else the ranks that recorded it) and its label."""
    members: dict[str, set[int]] = {}
    labels: dict[str, str] = {}
    for dump in dumps:
        for name, info in (dump.get("groups") or {}).items() if isinstance(dump, dict) else []:
            if isinstance(info, dict):
                members.setdefault(str(name), set()).update(r for r in _list(info.get("ranks")) if _is_rank(r, world))
                if info.get("desc") == "default_pg":
                    labels[str(name)] = ""
    for rank in ranks.values():
        for group in rank.entered:
            base = group.removesuffix(CUDA)
            members.setdefault(group, set()).update({rank.rank} | members.get(base, set()))
    for group in members:
        base = group.removesuffix(CUDA)
        if group != base:
            labels[group] = f" ({'default group' if labels.get(base) == '' else f'group {base}'}, NCCL)"
        labels.setdefault(group, f" (group {group})")
    return {g: sorted(m) for g, m in members.items() if m}, labels


def _group_findings(group: str, members: list[int], ranks: dict[int, Rank], labels: dict[str, str]) -> list[dict]:
    here = [ranks[r] for r in members if r in ranks]
    out = []
    # A mismatch: one sequence number, different collectives.
    for seq in sorted({s for r in here for s in r.calls.get(group, {})}):
        calls = {r.rank: r.calls[group][seq] for r in here if seq in r.calls.get(group, {})}
        kinds: dict[str, list[int]] = {}
        for rank, call in calls.items():
            key = call.op + (f" {_sizes(call)}" if call.op in SAME_SIZES else "")
            kinds.setdefault(key, []).append(rank)
        if len(kinds) > 1:
            ordered = sorted(kinds.items(), key=lambda kv: (len(kv[1]), kv[1]))  # the odd one out first
            sizes = len({k.split(" ")[0] for k in kinds}) == 1  # same op: the sizes differ
            text = ", ".join(
                f"{_ranks(rs)} in {calls[rs[0]].label(labels)}" + (f" of {_sizes(calls[rs[0]])}" if sizes else "")
                for _k, rs in ordered
            )
            done = all(c.done for c in calls.values())
            out.append({"kind": "mismatch_done" if done else "mismatch", "group": group, "seq": seq,
                        "op": calls[ordered[0][1][0]].op, "ranks": ordered[0][1],
                        "waiting": [r for _k, rs in ordered[1:] for r in rs], "text": text,
                        "since_ns": min(c.created_ns for c in calls.values())})  # fmt: skip
            break  # the first one explains the rest
    # The collective ranks wait in that others never entered.
    waiting = {r.rank: p[0] for r in here if (p := r.pending(group))}
    if waiting:
        target = min(waiting.values(), key=lambda c: c.seq)
        waiters = [r for r, c in waiting.items() if c.seq <= target.seq]
        wait = f"wait{'s' if len(waiters) == 1 else ''} in"
        absent = [r for r in members if r in ranks and ranks[r].entered.get(group, 0) < target.seq]
        unknown = [r for r in members if r not in ranks]
        if absent:
            out.append({"kind": "never_entered", "group": group, "seq": target.seq, "op": target.op,
                        "ranks": absent, "waiting": waiters, "since_ns": target.created_ns,
                        "text": f"{_ranks(absent)} never entered {target.label(labels)} that "
                                f"{_ranks(waiters)} {wait}"})  # fmt: skip
        elif unknown:
            out.append({"kind": "waits_on_silent", "group": group, "seq": target.seq, "op": target.op,
                        "ranks": unknown, "waiting": waiters, "since_ns": target.created_ns,
                        "text": f"{_ranks(waiters)} {wait} {target.label(labels)}; {_ranks(unknown)} of its group "
                                "did not answer"})  # fmt: skip
        elif not out:
            out.append({"kind": "all_entered", "group": group, "seq": target.seq, "op": target.op, "ranks": [],
                        "waiting": waiters, "since_ns": target.created_ns,
                        "text": f"every rank entered {target.label(labels)} and {_ranks(waiters)} never left it: "
                                "the collective itself is stuck (its transport, or a peer process gone)"})  # fmt: skip
    return out


def _finding_order(f: dict[str, Any]) -> tuple[int, int, int]:
    kind = {"mismatch": 0, "never_entered": 1, "waits_on_silent": 2, "all_entered": 3, "mismatch_done": 4}[f["kind"]]
    return kind, len(f["ranks"]), f.get("since_ns") or 0


def _no_collective_in_flight(ranks: dict[int, Rank]) -> list[dict[str, Any]]:
    if not ranks:
        return []
    places: dict[str, list[int]] = {}
    for rank in ranks.values():
        places.setdefault(_where_in_python(rank), []).append(rank.rank)
    where = "; ".join(f"{_ranks(rs)} at {place}" for place, rs in sorted(places.items(), key=lambda kv: min(kv[1])))
    blind = {r.recorder_error for r in ranks.values() if r.recorder_error}
    if len(blind) == 1 and all(r.recorder_error for r in ranks.values()):  # nothing to compare: say why
        text = f"no collective to compare ({blind.pop()}); the ranks' innermost frames: {where}"
    else:
        text = f"no rank waits in a collective: the ranks are in Python ({where})"
    return [{"kind": "no_collective", "ranks": sorted(ranks), "waiting": [], "text": text}]


def _elsewhere(absent: list[int], ranks: dict[int, Rank], labels: dict[str, str]) -> str:
    """Where the ranks that never came are instead."""
    parts = []
    for r in absent[:4]:
        rank = ranks.get(r)
        if rank is None:
            continue
        call = rank.waiting_in()
        parts.append(f"rank {r} waits in {call.label(labels)}" if call else f"rank {r} is at {_where_in_python(rank)}")
    return f"; {'; '.join(parts)}" if parts else ""


def _stuck_thread(rank: Rank) -> dict[str, Any] | None:
    """The thread that waits in the rank's collective (the recorder names it), else the main one."""
    call = rank.waiting_in()
    for t in rank.threads:
        if call is not None and call.thread is not None and _int(t.get("id"), 0) == call.thread:
            return t
    return next((t for t in rank.threads if t.get("main")), rank.threads[0] if rank.threads else None)


def _frames(thread: dict[str, Any] | None) -> list[dict[str, Any]]:
    frames = [f for f in _list((thread or {}).get("frames")) if isinstance(f, dict)]
    return [
        {"file": str(f.get("file", "?"))[:300], "line": _int(f.get("line"), 0), "func": str(f.get("func", "?"))[:100],
         "code": str(f.get("code", ""))[:200], "lib": bool(f.get("lib"))}
        for f in frames
    ]  # fmt: skip


def _where_in_python(rank: Rank) -> str:
    frames = _frames(_stuck_thread(rank))
    own = [f for f in frames if not f["lib"]]
    if not frames:
        return "an unknown place (no stack)"
    frame = own[-1] if own else frames[-1]
    text = f"{frame['file'].rsplit('/', 1)[-1]}:{frame['line']} in {frame['func']}"
    return text + (f" ({frame['code']})" if frame["code"] else "")


def _rank_state(rank: Rank | None, number: int, labels: dict[str, str]) -> dict[str, Any]:
    if rank is None:
        return {"rank": number, "state": "silent", "where": "did not answer", "frames": [], "innermost": None}
    call = rank.waiting_in()
    frames = _frames(_stuck_thread(rank))
    own = [f for f in frames if not f["lib"]][-USER_FRAMES:]
    waited = max(0.0, rank.time - call.created_ns / 1e9) if call and call.created_ns else None
    return {
        "rank": number,
        "state": "collective" if call else "python",
        "where": f"waits in {call.label(labels)}" if call else f"in Python at {_where_in_python(rank)}",
        "waiting_s": round(waited, 1) if waited is not None else None,
        "frames": own,
        "innermost": frames[-1] if frames else None,
        "recorder": rank.recorder_error or None,
    }


def _group_table(group: str, members: list[int], ranks: dict[int, Rank], labels: dict[str, str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for r in members:
        rank = ranks.get(r)
        if rank is None:
            rows.append({"rank": r, "entered": None, "completed": None, "last": None})
            continue
        entered = rank.entered.get(group, 0)
        call = rank.calls.get(group, {}).get(entered)
        last: dict[str, Any] | None = None
        if call is not None:
            last = {
                "seq": call.seq,
                "op": call.op,
                "sizes": _sizes(call),
                "state": "completed" if call.done else "waiting",
            }
        rows.append({"rank": r, "entered": entered, "completed": rank.completed.get(group, 0), "last": last})
    return {"group": group, "label": labels.get(group, "").strip(" ()") or "default group", "ranks": rows}


def _group_order(group: str) -> tuple[int, str]:
    return (int(group), "") if group.isdigit() else (1 << 30, group)


def _sizes(call: Call) -> str:
    dtypes = ",".join(str(d).lower() for d in call.dtypes[:4])
    return f"{call.sizes[:4]}{f' {dtypes}' if dtypes else ''}"[:120]


def _ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0, 2``, ``ranks 0–31`` (runs collapsed)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}–{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _is_rank(value: Any, world: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < world


def _int(value: Any, default: int) -> int:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else default
    except (TypeError, ValueError, OverflowError):
        return default


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
