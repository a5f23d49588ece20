import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { api, ok, type Me } from "./api/client";
import { onConnection, isOnline } from "./lib/connection";
import { setPrefsUser } from "./lib/prefs";
import { useRoute } from "./lib/route";
import { Cluster } from "./pages/Cluster";
import { Compare } from "./pages/Compare";
import { Datasets } from "./pages/Datasets";
import { Login } from "./pages/Login";
import { NewRun } from "./pages/NewRun";
import { NewSweep } from "./pages/NewSweep";
import { RunDetail } from "./pages/RunDetail";
import { Runs } from "./pages/Runs";
import { SweepDetail, Sweeps } from "./pages/Sweeps";
import { Loading } from "./components/ui";
import "./style.css";

function Banner() {
  const [online, setOnline] = useState(isOnline());
  useEffect(() => onConnection(setOnline), []);
  if (online) return null;
  return (
    <div class="banner" role="alert" data-testid="offline-banner">
      Connection to the server lost — reconnecting; the live view resumes where it stopped.
    </div>
  );
}

function App() {
  const route = useRoute();
  const [me, setMe] = useState<Me | null | undefined>(undefined);
  const page = route.path[0] ?? "runs";

  useEffect(() => {
    if (page === "login") return;
    api.GET("/api/v1/me").then(
      (r) => setMe(r.response.ok ? ok(r) : null),
      () => setMe(null),
    );
  }, [page]);

  if (page === "login") return <Login route={route} onLogin={setMe} />;
  if (me === undefined) return <Loading what="Signing in" />;
  if (me === null) {
    location.hash = "#/login";
    return null;
  }
  setPrefsUser(me.name); // view settings are remembered per user

  const logout = async () => {
    await api.DELETE("/api/v1/session");
    setMe(null);
    location.hash = "#/login";
  };
  const nav = (href: string, label: string, active: boolean) => (
    <a href={href} class={active ? "active" : ""}>
      {label}
    </a>
  );
  let body;
  if (page === "runs" && route.path[1]) body = <RunDetail id={Number(route.path[1])} />;
  else if (page === "new") body = <NewRun route={route} />;
  else if (page === "compare") body = <Compare route={route} />;
  else if (page === "cluster") body = <Cluster />;
  else if (page === "datasets") body = <Datasets />;
  else if (page === "sweeps" && route.path[1] === "new") body = <NewSweep route={route} />;
  else if (page === "sweeps" && route.path[1]) body = <SweepDetail id={Number(route.path[1])} />;
  else if (page === "sweeps") body = <Sweeps />;
  else body = <Runs />;

  return (
    <>
      <header class="topbar">
        <a class="brand" href="#/runs">
          torchyard
        </a>
        <nav>
          {nav("#/runs", "Runs", page === "runs")}
          {nav("#/new", "New run", page === "new")}
          {nav("#/compare", "Compare", page === "compare")}
          {nav("#/sweeps", "Sweeps", page === "sweeps")}
          {nav("#/cluster", "Cluster", page === "cluster")}
          {nav("#/datasets", "Datasets", page === "datasets")}
        </nav>
        <div class="who">
          <span>
            {me.name} <span class="muted">({me.role})</span>
          </span>
          <button class="btn btn-small btn-ghost" onClick={logout} data-testid="logout">
            Log out
          </button>
        </div>
      </header>
      <Banner />
      <main>{body}</main>
    </>
  );
}

render(<App />, document.getElementById("app") as HTMLElement);
