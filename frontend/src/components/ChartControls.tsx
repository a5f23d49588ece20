// The chart toolbar's view settings, the same on the run page and compare: smoothing (EMA, the raw
// line faint beneath), a log-scale y axis and, where there are ranks to tell apart, one line per rank.
import type { Prefs } from "../lib/prefs";

export function ChartControls({
  prefs,
  onChange,
  perRank = true,
}: {
  prefs: Prefs;
  onChange: (change: Partial<Prefs>) => void;
  perRank?: boolean;
}) {
  return (
    <div class="chart-controls">
      <label class="inline" title="exponential moving average, as TensorBoard's; the raw line stays faint beneath">
        <span class="muted">Smoothing</span>
        <input
          type="range"
          min={0}
          max={0.99}
          step={0.01}
          value={prefs.smoothing}
          onInput={(e) => onChange({ smoothing: Number((e.target as HTMLInputElement).value) })}
          data-testid="smoothing"
        />
        <span class="mono smoothing-value">{prefs.smoothing.toFixed(2)}</span>
      </label>
      <label class="inline">
        <input type="checkbox" checked={prefs.logY} onChange={(e) => onChange({ logY: (e.target as HTMLInputElement).checked })} data-testid="log-y" />
        <span>Log scale</span>
      </label>
      {perRank && (
        <label class="inline" title="one line per rank instead of the mean over ranks (the first 16 ranks)">
          <input type="checkbox" checked={prefs.perRank} onChange={(e) => onChange({ perRank: (e.target as HTMLInputElement).checked })} data-testid="per-rank" />
          <span>Per rank</span>
        </label>
      )}
    </div>
  );
}

/** Every point of the chart's keys as a file, from the server at full resolution (not the drawn,
 * downsampled points): CSV or JSON, per rank and step. */
export function Downloads({ runId, keys }: { runId: number; keys: string[] }) {
  const href = (key: string, format: string) =>
    `/api/v1/runs/${runId}/metrics/export?key=${encodeURIComponent(key)}&format=${format}`;
  return (
    <details class="downloads">
      <summary title="every point the run logged, per rank and step: full resolution, not the drawn points">Download</summary>
      <div class="downloads-menu">
        {keys.map((key) => (
          <div class="nowrap">
            <span class="mono">{key}</span>{" "}
            <a href={href(key, "csv")} download data-testid={`download-${key}-csv`}>
              CSV
            </a>{" "}
            ·{" "}
            <a href={href(key, "json")} download data-testid={`download-${key}-json`}>
              JSON
            </a>
          </div>
        ))}
        <div class="muted">every point (full resolution), per rank and step</div>
      </div>
    </details>
  );
}
