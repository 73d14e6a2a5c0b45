import { useEffect, useState } from "react";
import { type ApiError, asApiError, type Me, resumeSession, signOut, whenSignedOut } from "./api";
import { Audit } from "./Audit";
import { Artifacts, Models } from "./Catalog";
import { ErrorNote } from "./ErrorNote";
import { Hardware } from "./Hardware";
import { JobPage, Jobs } from "./Jobs";
import { Nodes } from "./Nodes";
import { People } from "./People";
import { Provisioning } from "./Provisioning";
import { navigate, type Route, SCREENS, useRoute } from "./route";
import { ServicePage, Services } from "./Services";
import { SignIn } from "./SignIn";

function Screen({ route }: { route: Route }) {
  switch (route.screen) {
    case "hardware":
      return <Hardware />;
    case "nodes":
      return <Nodes />;
    case "jobs":
      return route.id ? <JobPage key={route.id} jobId={route.id} /> : <Jobs />;
    case "services":
      return route.id ? <ServicePage key={route.id} serviceId={route.id} /> : <Services />;
    case "models":
      return <Models />;
    case "artifacts":
      return <Artifacts />;
    case "provisioning":
      return <Provisioning />;
    case "audit":
      return <Audit />;
    case "people":
      return <People />;
  }
}

export function App() {
  // undefined: not known yet; null: signed out.
  const [signedIn, setSignedIn] = useState<Me | null | undefined>(undefined);
  const route = useRoute();
  const [notice, setNotice] = useState<string | null>(null);
  const [signOutError, setSignOutError] = useState<ApiError | null>(null);

  useEffect(() => {
    whenSignedOut(() => {
      setSignedIn(null);
      setNotice("Your console session ended. Sign in again.");
    });
    void resumeSession().then(setSignedIn);
  }, []);

  if (signedIn === undefined) return <p className="loading">Loading…</p>;
  if (signedIn === null)
    return (
      <SignIn
        notice={notice}
        onSignedIn={(me) => {
          setNotice(null);
          setSignedIn(me);
        }}
      />
    );
  // Screens the role cannot read are not offered (the API refuses them anyway).
  const screens = SCREENS.filter(({ area }) => signedIn.may.includes(`${area}:read`));

  return (
    <div className="shell">
      <header className="topbar">
        <span className="brand">ModelForge</span>
        <nav aria-label="Main">
          {screens.map(({ screen, title }) => (
            <a
              key={screen}
              href={"/" + screen}
              aria-current={route.screen === screen ? "page" : undefined}
              onClick={(event) => navigate(event, "/" + screen)}
            >
              {title}
            </a>
          ))}
        </nav>
        <span className="who" title={signedIn.actor}>
          {signedIn.user ?? "admin token"} ({signedIn.role})
        </span>
        <button
          type="button"
          className="secondary"
          onClick={() => {
            signOut().then(
              () => {
                setNotice("Signed out.");
                setSignedIn(null);
              },
              (caught: unknown) => setSignOutError(asApiError(caught)),
            );
          }}
        >
          Sign out
        </button>
      </header>
      <main>
        <ErrorNote error={signOutError} />
        <Screen route={route} />
      </main>
    </div>
  );
}
