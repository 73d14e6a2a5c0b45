import { useEffect, useState } from "react";
import { type ApiError, asApiError, resumeSession, signOut, whenSignedOut } from "./api";
import { Audit } from "./Audit";
import { Artifacts, Models } from "./Catalog";
import { ErrorNote } from "./ErrorNote";
import { Hardware } from "./Hardware";
import { JobPage, Jobs } from "./Jobs";
import { Nodes } from "./Nodes";
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
  }
}

export function App() {
  const [signedIn, setSignedIn] = useState<boolean | null>(null);
  const route = useRoute();
  const [notice, setNotice] = useState<string | null>(null);
  const [signOutError, setSignOutError] = useState<ApiError | null>(null);

  useEffect(() => {
    whenSignedOut(() => {
      setSignedIn(false);
      setNotice("Your console session ended. Sign in again.");
    });
    void resumeSession().then(setSignedIn);
  }, []);

  if (signedIn === null) return <p className="loading">Loading…</p>;
  if (!signedIn)
    return (
      <SignIn
        notice={notice}
        onSignedIn={() => {
          setNotice(null);
          setSignedIn(true);
        }}
      />
    );

  return (
    <div className="shell">
      <header className="topbar">
        <span className="brand">ModelForge</span>
        <nav aria-label="Main">
          {SCREENS.map(({ screen, title }) => (
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
        <button
          type="button"
          className="secondary"
          onClick={() => {
            signOut().then(
              () => {
                setNotice("Signed out.");
                setSignedIn(false);
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
