// A sweep's figures: the objective and its best so far per trial (uPlot), the parameters against the
// objective in parallel coordinates (SVG), and each parameter's importance (GET .../importance).
import { useEffect, useRef } from "preact/hooks";
import type uPlot from "uplot";
import { api, ok } from "../api/client";
import type { components } from "../api/schema";
import { fmtNumber } from "../lib/format";
import { type Axis, axisPos, bestSoFar, paramAxes, rankColor, valueAxis } from "../lib/sweeps";
import { Chart, type ChartHandle, PALETTE } from "./Chart";
import { ErrorBox, Loading, usePoll } from "./ui";

type Sweep = components["schemas"]["SweepOut"];
type Trial = components["schemas"]["TrialOut"];
type Direction = "minimize" | "maximize";

/** Each complete trial's objective (dots) and the best so far (line), by trial number. */
export function BestSoFar({ trials, metric, direction }: { trials: Trial[]; metric: string; direction: Direction }) {
  const best = bestSoFar(trials, direction);
  const data: uPlot.AlignedData = [
    trials.map((t) => t.number),
    trials.map((t) => (t.state === "complete" ? (t.value ?? null) : null)),
    best,
  ];
  const dataRef = useRef(data);
  dataRef.current = data;
  const handle = useRef<ChartHandle | null>(null);
  const key = data.map((col) => Array.from(col).join(",")).join("|");
  useEffect(() => handle.current?.setData(dataRef.current), [key]);
  return (
    <div class="card">
      <Chart
        title={`${metric}: each trial and the best so far`}
        help={direction}
        xLabel="trial"
        series={[
          { label: metric, color: PALETTE[0], points: true },
          { label: "best so far", color: PALETTE[2], width: 2 },
        ]}
        testId="sweep-best"
        handle={(h) => {
          handle.current = h;
          h?.setData(dataRef.current);
        }}
      />
    </div>
  );
}

const PAD = { left: 90, right: 90, top: 28, bottom: 34 }; // room for a path's name centred on the first and last axes
const HEIGHT = 280;

/** One vertical axis per parameter and one for the objective; a line per trial through its values,
 * coloured by its objective (blue: best); a trial with no value (pruned, failed) in grey, dashed,
 * across its parameters only. */
export function ParallelCoords({ sweep, direction }: { sweep: Sweep; direction: Direction }) {
  const axes = paramAxes(sweep.spec.space as Record<string, { type: string }>);
  const values = sweep.trials.filter((t) => t.state === "complete" && t.value != null).map((t) => t.value as number);
  const objective = valueAxis(values);
  const all: Axis[] = objective ? [...axes, objective] : axes;
  const width = Math.max(640, all.length * 230);
  const gap = all.length > 1 ? (width - PAD.left - PAD.right) / (all.length - 1) : 0;
  const x = (i: number) => PAD.left + i * gap;
  const y = (pos: number) => PAD.top + (1 - pos) * (HEIGHT - PAD.top - PAD.bottom);
  const rank = (v: number) => {
    if (!objective) return 0;
    const t = (v - objective.lo) / (objective.hi - objective.lo);
    return direction === "minimize" ? t : 1 - t;
  };
  const label = (a: Axis, end: "lo" | "hi") =>
    a.choices ? "" : a.log ? Number(a[end].toPrecision(2)).toExponential(0) : fmtNumber(a[end]);
  // worst first, so the best lines are drawn on top
  const lines = [...sweep.trials].sort((a, b) => (b.value == null ? 1 : rank(b.value)) - (a.value == null ? 1 : rank(a.value)));
  return (
    <div class="card" data-testid="sweep-parallel">
      <div class="card-head">
        <h2>Parameters and {sweep.spec.objective?.metric ?? "loss"}</h2>
        <span class="muted">one line per trial · blue: best · grey dashed: no value (pruned, failed, running)</span>
      </div>
      <svg viewBox={`0 0 ${width} ${HEIGHT}`} width="100%" style={{ maxWidth: `${width}px` }} role="img">
        {lines.map((t) => {
          const done = t.state === "complete" && t.value != null;
          const points = all
            .map((a, i) => {
              const pos = a === objective ? (done ? axisPos(a, t.value) : null) : axisPos(a, t.params[a.path]);
              return pos === null ? null : `${x(i).toFixed(1)},${y(pos).toFixed(1)}`;
            })
            .filter((p) => p !== null);
          return (
            <polyline
              data-trial={t.number}
              points={points.join(" ")}
              fill="none"
              stroke={done ? rankColor(rank(t.value as number)) : "#94a3b8"}
              stroke-width={done ? 2 : 1.2}
              stroke-dasharray={done ? undefined : "4 3"}
              opacity={done ? 0.9 : 0.7}
            >
              <title>
                trial {t.number}: {t.state}
                {done ? ` ${fmtNumber(t.value)}` : ""}
              </title>
            </polyline>
          );
        })}
        {all.map((a, i) => (
          <g data-axis={a.path} data-log={a.log ? "on" : "off"}>
            <line x1={x(i)} x2={x(i)} y1={y(0)} y2={y(1)} stroke="#64748b" />
            <text x={x(i)} y={PAD.top - 12} text-anchor="middle" font-size="11" font-weight="600" fill="#334155">
              {a === objective ? (sweep.spec.objective?.metric ?? "loss") : a.path}
              {a.log ? " (log)" : ""}
            </text>
            <text x={x(i) + 4} y={y(1) + 4} font-size="10" fill="#64748b">
              {label(a, "hi")}
            </text>
            <text x={x(i) + 4} y={y(0) + 12} font-size="10" fill="#64748b">
              {label(a, "lo")}
            </text>
            {(a.choices ?? []).map((c) => (
              <text x={x(i) + 4} y={y(axisPos(a, c) ?? 0) + 4} font-size="10" fill="#64748b">
                {String(c)}
              </text>
            ))}
          </g>
        ))}
      </svg>
    </div>
  );
}

/** Each parameter's importance to the objective (Optuna's PED-ANOVA, computed by the api), read
 * again as trials complete. */
export function Importance({ id, complete }: { id: number; complete: number }) {
  const { data, error, reload } = usePoll(
    async () => ok(await api.GET("/api/v1/sweeps/{sweep_id}/importance", { params: { path: { sweep_id: id } } })),
    [id, complete],
  );
  return (
    <div class="card" data-testid="sweep-importance">
      <div class="card-head">
        <h2>Parameter importance</h2>
        {data && (
          <span class="muted">
            Optuna {data.evaluator} over {data.trials} complete trial{data.trials === 1 ? "" : "s"}
          </span>
        )}
      </div>
      {error !== undefined && <ErrorBox error={error} retry={reload} />}
      {data === undefined && error === undefined && <Loading what="Weighing the parameters" />}
      {data && data.trials < 2 && <p class="muted">It needs at least two complete trials.</p>}
      {data && data.trials >= 2 && (
        <table class="table">
          <tbody>
            {Object.entries(data.importance)
              .sort((a, b) => b[1] - a[1])
              .map(([path, v]) => (
                <tr data-param={path}>
                  <td class="mono">{path}</td>
                  <td style={{ width: "60%" }}>
                    <div style={{ background: PALETTE[0], height: "10px", width: `${Math.max(0.5, v * 100)}%`, borderRadius: "2px" }} />
                  </td>
                  <td class="num">{(v * 100).toFixed(1)}%</td>
                </tr>
              ))}
          </tbody>
        </table>
      )}
    </div>
  );
}
