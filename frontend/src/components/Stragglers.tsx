// Why is it slow: the rank the others wait for and its cause (the server's attribution over the
// newest steps, backend/stragglers.py), every rank's medians, and a ranks × steps heatmap of the
// step time or one of its parts (downsampled on the server).
import { useEffect, useRef, useState } from "preact/hooks";
import { api, ok } from "../api/client";
import type { components } from "../api/schema";
import { cellAt, colour, colourRange } from "../lib/heatmap";
import { ErrorBox, Loading, usePoll } from "./ui";

type StragglersOut = components["schemas"]["StragglersOut"];
type Heatmap = components["schemas"]["Heatmap"];

const POLL_MS = 5000;
const PARTS: [string, string][] = [
  ["step_time_s", "Step time"],
  ["data_time_s", "Data"],
  ["compute_time_s", "Compute"],
  ["exposed_comm_s", "Exposed comm"],
  ["first_comm_at_s", "Arrival at the first collective"],
];
const MAX_HEIGHT_PX = 320;
const ms = (s: number | null | undefined) => (s === null || s === undefined ? "—" : `${(s * 1e3).toFixed(1)} ms`);

/** ``onNamed``: the ranks the attribution names, each time it is read (the Ranks table marks them). */
export function Stragglers({
  id,
  active,
  status,
  onNamed,
}: {
  id: number;
  active: boolean;
  status: string;
  onNamed?: (ranks: number[]) => void;
}) {
  const { data, error } = usePoll(
    async () => ok(await api.GET("/api/v1/runs/{run_id}/stragglers", { params: { path: { run_id: id } } })),
    [id, status],
    active ? POLL_MS : undefined,
  );
  const named = data ? data.stragglers.map((s) => s.rank).join(",") : "";
  useEffect(() => onNamed?.(named ? named.split(",").map(Number) : []), [named, onNamed]);
  return (
    <div class="card" data-testid="stragglers">
      <div class="card-head">
        <h2>Stragglers</h2>
        {data ? (
          <span class="muted">
            steps {data.step_min.toLocaleString("en-US")}–{data.step_max.toLocaleString("en-US")}, medians per rank
          </span>
        ) : null}
      </div>
      {error ? <ErrorBox error={error} /> : data === undefined ? <Loading what="Finding stragglers" /> : <Attribution d={data} />}
      <RankHeatmap id={id} active={active} status={status} />
    </div>
  );
}

function Attribution({ d }: { d: StragglersOut }) {
  const named = new Set(d.stragglers.map((s) => s.rank));
  return (
    <div>
      <p>
        <strong data-testid="stragglers-headline" data-stragglers={d.stragglers.length}>
          {d.headline}
        </strong>
      </p>
      <p class="muted">
        A rank is a straggler when it reaches the step's first collective late and the others wait about as long there
        (their exposed comm){d.threshold_s !== null ? `: ${ms(d.threshold_s)}/step or more` : ""}. Data includes the copy to
        the device.
      </p>
      {d.ranks.length ? (
        <details open={d.ranks.length <= 8} data-testid="straggler-ranks">
          <summary>Every rank's medians</summary>
          <table class="table">
            <thead>
              <tr>
                <th class="num">Rank</th>
                <th class="num">Step</th>
                <th class="num">Data</th>
                <th class="num">Compute</th>
                <th class="num">Exposed comm</th>
                <th class="num">First collective at</th>
              </tr>
            </thead>
            <tbody>
              {d.ranks.map((r) => (
                <tr data-rank={r.rank} class={named.has(r.rank) ? "slowest" : ""}>
                  <td class="num">
                    {r.rank}
                    {named.has(r.rank) ? <span class="tag">straggler</span> : null}
                  </td>
                  <td class="num">{ms(r.step_time_s)}</td>
                  <td class="num">{ms(r.data_time_s)}</td>
                  <td class="num">{ms(r.compute_time_s)}</td>
                  <td class="num">{ms(r.exposed_comm_s)}</td>
                  <td class="num">{ms(r.first_comm_at_s)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </details>
      ) : null}
    </div>
  );
}

/** Ranks (rows) × steps (columns), each cell the rank's mean over the column's steps. Drawn one
 * pixel per cell into an image and scaled up without smoothing: any size costs one draw. */
function RankHeatmap({ id, active, status }: { id: number; active: boolean; status: string }) {
  const [key, setKey] = useState("step_time_s");
  const [hover, setHover] = useState<string>("");
  const box = useRef<HTMLDivElement>(null);
  const canvas = useRef<HTMLCanvasElement>(null);
  const { data, error } = usePoll(
    async () => {
      const columns = Math.max(16, Math.floor((box.current?.clientWidth ?? 800) / 2));
      const query = { key, max_points: Math.min(2000, columns) };
      return ok(await api.GET("/api/v1/runs/{run_id}/heatmap", { params: { path: { run_id: id }, query } })) as Heatmap;
    },
    [id, status, key],
    active ? POLL_MS : undefined,
  );
  const range = data ? colourRange(data.values) : null;
  const rows = data?.ranks.length ?? 0;
  const cols = data?.steps.length ?? 0;
  const rowPx = rows ? Math.max(2, Math.min(18, Math.floor(MAX_HEIGHT_PX / rows))) : 0;

  useEffect(() => {
    const c = canvas.current;
    if (!c || !data || !rows || !cols) return;
    c.width = c.clientWidth || 800;
    c.height = rows * rowPx;
    const image = new ImageData(cols, rows);
    data.values.forEach((row, r) =>
      row.forEach((v, k) => {
        const [red, green, blue] = colour(v, range);
        image.data.set([red, green, blue, 255], (r * cols + k) * 4);
      }),
    );
    const cells = document.createElement("canvas");
    cells.width = cols;
    cells.height = rows;
    cells.getContext("2d")?.putImageData(image, 0, 0);
    const ctx = c.getContext("2d");
    if (!ctx) return;
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cells, 0, 0, c.width, c.height);
  }, [data, rows, cols, rowPx, range?.[0], range?.[1]]); // eslint-disable-line react-hooks/exhaustive-deps

  const onMove = (e: MouseEvent) => {
    const c = canvas.current;
    if (!c || !data) return;
    const rect = c.getBoundingClientRect();
    const cell = cellAt(e.clientX - rect.left, e.clientY - rect.top, rect.width, rect.height, rows, cols);
    if (!cell) return setHover("");
    const [r, k] = cell;
    const first = data.steps[k] as number;
    const last = k + 1 < cols ? (data.steps[k + 1] as number) - 1 : data.step_max;
    const steps = first === last ? `step ${first.toLocaleString("en-US")}` : `steps ${first.toLocaleString("en-US")}–${last.toLocaleString("en-US")}`;
    setHover(`rank ${data.ranks[r]}, ${steps}: ${ms(data.values[r]?.[k])}`);
  };

  return (
    <div class="heatmap" ref={box}>
      <div class="card-head">
        <h3>Per rank over the steps</h3>
        <label class="muted">
          colour ={" "}
          <select value={key} onChange={(e) => setKey((e.target as HTMLSelectElement).value)} data-testid="heatmap-key">
            {PARTS.map(([k, label]) => (
              <option value={k}>{label}</option>
            ))}
          </select>
        </label>
      </div>
      {error ? <ErrorBox error={error} /> : null}
      {data === undefined ? (
        <Loading what="Loading the heatmap" />
      ) : !rows ? (
        <div class="state state-empty">No {key} logged yet.</div>
      ) : (
        <>
          <div class="heatmap-plot">
            <div class="heatmap-ranks muted" style={{ height: `${rows * rowPx}px` }}>
              <span>rank {data.ranks[0]}</span>
              {rows > 1 ? <span>rank {data.ranks[rows - 1]}</span> : null}
            </div>
            <canvas
              ref={canvas}
              data-testid="heatmap"
              data-ranks={rows}
              data-columns={cols}
              onMouseMove={onMove}
              onMouseLeave={() => setHover("")}
            />
          </div>
          <div class="heatmap-axis muted">
            <span>step {data.step_min.toLocaleString("en-US")}</span>
            <span data-testid="heatmap-hover">{hover}</span>
            <span>
              {data.bucket_steps > 1 ? `${data.bucket_steps.toLocaleString("en-US")} steps a column · ` : ""}
              step {data.step_max.toLocaleString("en-US")}
            </span>
          </div>
          <div class="heatmap-legend muted" data-testid="heatmap-legend">
            <span>{ms(range?.[0])}</span>
            <span class="heatmap-scale" />
            <span>{ms(range?.[1])}</span>
            <span>(mean per cell; 1st–99th percentile)</span>
          </div>
        </>
      )}
    </div>
  );
}
