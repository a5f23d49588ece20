// The dashboard's view settings, remembered per signed-in user in localStorage: which chart
// sections are folded, the smoothing, the log scale, per-rank lines.

export interface Prefs {
  collapsed: Record<string, boolean>;
  smoothing: number; // EMA weight, 0: raw
  logY: boolean;
  perRank: boolean;
  showNoise: boolean; // the log panel's folded lines
}

const DEFAULTS: Prefs = { collapsed: {}, smoothing: 0, logY: false, perRank: false, showNoise: false };
let user = "anonymous";

export function setPrefsUser(name: string): void {
  user = name;
}

function storageKey(): string {
  return `torchyard:prefs:${user}`;
}

export function loadPrefs(): Prefs {
  try {
    const raw = localStorage.getItem(storageKey());
    const saved = raw ? (JSON.parse(raw) as Partial<Prefs>) : {};
    return { ...DEFAULTS, ...saved, collapsed: { ...(saved.collapsed ?? {}) } };
  } catch {
    return { ...DEFAULTS, collapsed: {} }; // storage off or a bad value: the defaults
  }
}

export function savePrefs(change: Partial<Prefs>): Prefs {
  const next = { ...loadPrefs(), ...change };
  try {
    localStorage.setItem(storageKey(), JSON.stringify(next));
  } catch {
    // private mode or full: the setting lasts for this page only
  }
  return next;
}
