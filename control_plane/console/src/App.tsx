import { useCallback, useEffect, useState } from "react";
import { type ApiError, asApiError, resumeSession, signOut, whenSignedOut } from "./api";
import { ErrorNote } from "./ErrorNote";
import { Hardware } from "./Hardware";
import { Nodes } from "./Nodes";
import { SignIn } from "./SignIn";

type Screen = "hardware" | "nodes";

function screenFromPath(): Screen {
  return window.location.pathname.startsWith("/nodes") ? "nodes" : "hardware";
}

export function App() {
  const [signedIn, setSignedIn] = useState<boolean | null>(null);
  const [screen, setScreen] = useState<Screen>(screenFromPath);
  const [notice, setNotice] = useState<string | null>(null);
  const [signOutError, setSignOutError] = useState<ApiError | null>(null);

  useEffect(() => {
    whenSignedOut(() => {
      setSignedIn(false);
      setNotice("Your console session ended. Sign in again.");
    });
    void resumeSession().then(setSignedIn);
    const onPop = () => setScreen(screenFromPath());
    window.addEventListener("popstate", onPop);
    return () => window.removeEventListener("popstate", onPop);
  }, []);

  const go = useCallback((next: Screen) => {
    window.history.pushState(null, "", "/" + next);
    setScreen(next);
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
          {(["hardware", "nodes"] as const).map((name) => (
            <a
              key={name}
              href={"/" + name}
              aria-current={screen === name ? "page" : undefined}
              onClick={(event) => {
                event.preventDefault();
                go(name);
              }}
            >
              {name === "hardware" ? "Hardware" : "Nodes"}
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
        {screen === "hardware" ? <Hardware /> : <Nodes />}
      </main>
    </div>
  );
}
