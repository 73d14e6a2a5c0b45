import { type MouseEvent, useEffect, useState } from "react";

// The console's routes: /<screen>[/<id>]. Links push history entries; Back and Forward work.
export type Screen =
  | "hardware"
  | "nodes"
  | "jobs"
  | "services"
  | "models"
  | "artifacts"
  | "provisioning"
  | "audit"
  | "people";

// Each screen's area (docs/access.md): shown to a role that may read it.
export const SCREENS: readonly { screen: Screen; title: string; area: string }[] = [
  { screen: "hardware", title: "Hardware", area: "fleet" },
  { screen: "nodes", title: "Nodes", area: "fleet" },
  { screen: "jobs", title: "Jobs", area: "work" },
  { screen: "services", title: "Services", area: "work" },
  { screen: "models", title: "Models", area: "work" },
  { screen: "artifacts", title: "Artifacts", area: "work" },
  { screen: "provisioning", title: "Provisioning", area: "fleet" },
  { screen: "audit", title: "Audit", area: "audit" },
  { screen: "people", title: "People", area: "self" },
];

export interface Route {
  screen: Screen;
  id: string | null;
}

function parse(pathname: string): Route {
  const [first = "", second] = pathname.split("/").filter(Boolean);
  const known = SCREENS.find((entry) => entry.screen === first);
  return { screen: known ? known.screen : "hardware", id: known && second ? decodeURIComponent(second) : null };
}

const CHANGED = "modelforge:route";

// Go to `path` in the console; with an event (a link's click), only a plain left click is
// taken over: a middle click or Ctrl-click still opens a new tab.
export function navigate(event: MouseEvent | null, path: string): void {
  if (event) {
    if (event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
    event.preventDefault();
  }
  window.history.pushState(null, "", path);
  window.dispatchEvent(new Event(CHANGED));
}

export function useRoute(): Route {
  const [route, setRoute] = useState<Route>(() => parse(window.location.pathname));
  useEffect(() => {
    const update = () => setRoute(parse(window.location.pathname));
    window.addEventListener("popstate", update);
    window.addEventListener(CHANGED, update);
    return () => {
      window.removeEventListener("popstate", update);
      window.removeEventListener(CHANGED, update);
    };
  }, []);
  return route;
}
