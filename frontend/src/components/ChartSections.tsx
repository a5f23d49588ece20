// The run page's charts in sections (training, speed, communication, system, other), each folded
// or open as the user last left it.
import type { ComponentChildren } from "preact";
import { SECTIONS, type ChartDef } from "../lib/runview";

export function ChartSections({
  defs,
  collapsed,
  onToggle,
  chart,
}: {
  defs: ChartDef[];
  collapsed: Record<string, boolean>;
  onToggle: (section: string, collapsed: boolean) => void;
  chart: (def: ChartDef) => ComponentChildren;
}) {
  return (
    <>
      {SECTIONS.map((section) => {
        const mine = defs.filter((d) => d.section === section.id);
        if (!mine.length) return null;
        const open = !collapsed[section.id];
        return (
          <section class="chart-section" data-testid={`section-${section.id}`} data-open={open ? "true" : "false"}>
            <button
              class="section-head"
              aria-expanded={open}
              onClick={() => onToggle(section.id, open)}
              data-testid={`toggle-${section.id}`}
            >
              <span class="caret">{open ? "▾" : "▸"}</span> {section.title}{" "}
              <span class="muted">
                · {mine.length} chart{mine.length > 1 ? "s" : ""} · {section.help}
              </span>
            </button>
            {open && <div class="charts">{mine.map(chart)}</div>}
          </section>
        );
      })}
    </>
  );
}
