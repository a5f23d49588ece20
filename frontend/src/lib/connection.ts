// Whether the api is reachable, as the last request or stream saw it: drives the banner.
type Listener = (online: boolean) => void;
const listeners = new Set<Listener>();
let online = true;

export function setOnline(value: boolean): void {
  if (value === online) return;
  online = value;
  listeners.forEach((l) => l(value));
}

export function isOnline(): boolean {
  return online;
}

export function onConnection(listener: Listener): () => void {
  listeners.add(listener);
  return () => listeners.delete(listener);
}
