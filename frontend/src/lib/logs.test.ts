import { describe, expect, it } from "vitest";
import { LogBuffer, noiseKind, noiseKinds, tracebackLines, type Line } from "./logs";

const line = (id: number, ts: number, text = `line ${id}`, rank = 0): Line => ({ id, attempt: 1, rank, ts, text });

describe("noise", () => {
  it("folds profiler trace points and framework warnings, never a traceback", () => {
    expect(noiseKind("USDT:2026-12-04 19:12:15 18:18 SyncActivityProfilerHandler.cpp:52] profiler_start")).toBe("profiler");
    expect(noiseKind("/usr/lib/python3/dist-packages/torch/distributed/fsdp/_x.py:12: UserWarning: foo")).toBe("warning");
    expect(noiseKind("  warnings.warn(")).toBe("warning");
    expect(noiseKind("[W1204 19:12:15.123 1 ProcessGroupGloo.cpp:12] Warning: bar")).toBe("warning");
    for (const keep of ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "RuntimeError: boom", "step 3/30 loss 2.08"])
      expect(noiseKind(keep)).toBeNull();
  });
});

describe("a Python warning's source line", () => {
  it("folds with its warning, whatever it reads, per rank", () => {
    const lines = [
      { rank: 0, text: "/x/torch/nn/modules/module.py:12: UserWarning: deprecated" },
      { rank: 1, text: "step 3/30 loss 2.08" }, // another rank's line in between
      { rank: 0, text: "  return self._call_impl(*args, **kwargs)" }, // was shown alone
      { rank: 0, text: "  indented output of the user's own" }, // not after a warning: kept
      { rank: 1, text: "Traceback (most recent call last):" },
      { rank: 1, text: '  File "train.py", line 3, in <module>' }, // a traceback's line: kept
    ];
    expect(noiseKinds(lines)).toEqual(["warning", null, "warning", null, null, null]);
  });
});

describe("LogBuffer", () => {
  it("holds the tail, pages back in front, and knows when the start is reached", () => {
    const b = new LogBuffer(10);
    b.setTail([line(8, 8), line(9, 9)], 2);
    expect(b.startReached).toBe(false);
    expect(b.oldestId()).toBe(8);
    expect(b.prepend([line(6, 6), line(7, 7)], 2)).toBe(true);
    expect(b.prepend([line(5, 5)], 2)).toBe(true);
    expect(b.startReached).toBe(true);
    expect(b.lines.map((l) => l.id)).toEqual([5, 6, 7, 8, 9]);
  });
  it("keeps live lines newer than the tail read, drops those it already held, and stays bounded", () => {
    const b = new LogBuffer(4);
    b.append([line(0, 8.5, "live early")]); // the stream starts before the read
    b.setTail([line(8, 8), line(9, 9)], 5);
    expect(b.lines.map((l) => l.ts)).toEqual([8, 9]);
    b.append([line(0, 9, "held"), line(0, 10), line(0, 11), line(0, 12, "newest", 1)]);
    expect(b.lines.map((l) => l.ts)).toEqual([9, 10, 11, 12]);
    expect(b.startReached).toBe(false);
    expect(b.prepend([line(1, 1), line(2, 2)], 5)).toBe(false); // past the bound: refused
  });
});

describe("tracebackLines", () => {
  it("takes a traceback up to its exception line, chained ones too", () => {
    const texts = [
      "Traceback (most recent call last):",
      '  File "a.py", line 1, in <module>',
      "KeyError: 'x'",
      "",
      "During handling of the above exception, another exception occurred:",
      "",
      "Traceback (most recent call last):",
      '  File "a.py", line 3, in <module>',
      "RuntimeError: boom",
      "line 5801",
    ];
    const lines = texts.map((t, i) => line(i + 1, i, t));
    expect(tracebackLines(lines).map((l) => l.text)).toEqual(texts.slice(0, -1));
    expect(tracebackLines(lines.slice(6)).map((l) => l.text)).toEqual(texts.slice(6, 9));
  });
  it("leaves out the rank's printed lines relayed in between (stdout and stderr come apart)", () => {
    const texts = [
      "Traceback (most recent call last):",
      "line 9870",
      '  File "crash.py", line 11, in <module>',
      "line 9871",
      '    raise RuntimeError("boom")',
      "step 3 of 10 done",
      "USDT:2026-12-04 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start",
      "RuntimeError: boom",
      "line 9872",
    ];
    const lines = texts.map((t, i) => line(i + 1, i, t));
    expect(tracebackLines(lines).map((l) => l.text)).toEqual([texts[0], texts[2], texts[4], texts[7]]);
  });
});
