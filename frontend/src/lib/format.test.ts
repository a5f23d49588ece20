import { describe, expect, it } from "vitest";
import { fmtAge, fmtAxis, fmtDuration, fmtNumber, fmtPercent, fmtSI, parseTime } from "./format";

describe("format", () => {
  it("numbers", () => {
    expect(fmtNumber(null)).toBe("—");
    expect(fmtNumber(Number.NaN)).toBe("—");
    expect(fmtNumber(0.123456)).toBe("0.123");
    expect(fmtNumber(12345.6)).toBe("12,346");
    expect(fmtNumber(1e-5)).toBe("1.00e-5");
    expect(fmtSI(1234.5)).toBe("1.23k");
    expect(fmtSI(2_500_000)).toBe("2.5M");
    expect(fmtAxis(446_000_000)).toBe("446M");
    expect(fmtPercent(0.256)).toBe("26%");
    expect(fmtPercent(0.05)).toBe("5.0%");
  });
  it("durations", () => {
    expect(fmtDuration(0.0123)).toBe("12 ms");
    expect(fmtDuration(3.21)).toBe("3.2 s");
    expect(fmtDuration(125)).toBe("2m 05s");
    expect(fmtDuration(7380)).toBe("2h 03m");
    expect(fmtDuration(null)).toBe("—");
  });
  it("reads the api's zone-less times as UTC", () => {
    expect(parseTime("2026-01-01T00:00:00")).toBe(Date.UTC(2026, 0, 1));
    expect(parseTime("2026-01-01T00:00:00+00:00")).toBe(Date.UTC(2026, 0, 1));
    expect(fmtAge("2026-01-01T00:00:00", Date.UTC(2026, 0, 1, 0, 3))).toBe("3m ago");
  });
});
