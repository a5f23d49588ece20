import { useEffect, useState } from "preact/hooks";
import { api, type Me } from "../api/client";
import type { Route } from "../lib/route";

export function Login({ route, onLogin }: { route: Route; onLogin: (me: Me) => void }) {
  const [token, setToken] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);

  const submit = async (value: string) => {
    setBusy(true);
    setError(null);
    try {
      const r = await api.POST("/api/v1/session", { body: { token: value } });
      if (!r.response.ok || !r.data) {
        setError(r.response.status === 401 ? "That token is unknown or revoked." : `Login failed (${r.response.status}).`);
        return;
      }
      onLogin(r.data);
      location.replace("#/runs"); // the token leaves the address bar and the history
    } catch {
      setError("The server cannot be reached.");
    } finally {
      setBusy(false);
    }
  };

  const linkToken = route.query.get("token");
  useEffect(() => {
    if (linkToken) void submit(linkToken);
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [linkToken]);

  return (
    <div class="login">
      <form
        class="card login-card"
        onSubmit={(e) => {
          e.preventDefault();
          void submit(token);
        }}
      >
        <h1>torchyard</h1>
        <p class="muted">Open the link that <code>torchyard up</code> printed, or paste a token.</p>
        <label class="field">
          <span>Token</span>
          <input
            type="password"
            name="token"
            autocomplete="off"
            value={token}
            onInput={(e) => setToken((e.target as HTMLInputElement).value)}
            placeholder="ty_…"
          />
        </label>
        {error && (
          <div class="field-error" role="alert">
            {error}
          </div>
        )}
        <button class="btn btn-primary" type="submit" disabled={busy || (!token && !linkToken)}>
          {busy ? "Signing in…" : "Sign in"}
        </button>
      </form>
    </div>
  );
}
