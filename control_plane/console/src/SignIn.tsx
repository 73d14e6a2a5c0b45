import { type FormEvent, useEffect, useState } from "react";
import { type ApiError, asApiError, type Credentials, type Me, signIn, signInOptions } from "./api";
import { ErrorNote } from "./ErrorNote";

// A user's name and password, or (break-glass) the admin token, is exchanged for a session
// cookie. Neither is kept: the fields are cleared once the exchange answers, either way.
export function SignIn({ notice, onSignedIn }: { notice: string | null; onSignedIn: (me: Me) => void }) {
  const [name, setName] = useState("");
  const [password, setPassword] = useState("");
  const [token, setToken] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);
  // The organisation's OpenID provider, when the control plane has one (its display name).
  const [sso, setSso] = useState<string | null>(null);

  useEffect(() => {
    void signInOptions().then((options) => setSso(options.sso), () => setSso(null));
  }, []);

  async function exchange(event: FormEvent, credentials: Credentials) {
    event.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const me = await signIn(credentials);
      onSignedIn(me);
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setPassword("");
      setToken("");
      setBusy(false);
    }
  }

  return (
    <main className="signin">
      <h1>ModelForge console</h1>
      {notice && <p role="status">{notice}</p>}
      {sso && (
        // A plain link: the browser goes to the provider and comes back signed in.
        <p>
          <a className="button" href="/api/v1/console/oidc/login">
            Sign in with {sso}
          </a>
        </p>
      )}
      <form onSubmit={(event) => void exchange(event, { name: name.trim(), password })} aria-label="Sign in">
        <label htmlFor="user-name">Name</label>
        <input
          id="user-name"
          name="username"
          autoComplete="username"
          spellCheck={false}
          required
          value={name}
          onChange={(event) => setName(event.target.value)}
        />
        <label htmlFor="user-password">Password</label>
        <input
          id="user-password"
          name="password"
          type="password"
          autoComplete="current-password"
          required
          value={password}
          onChange={(event) => setPassword(event.target.value)}
        />
        <button type="submit" disabled={busy}>
          Sign in
        </button>
      </form>
      <details>
        <summary>Sign in with the admin token (break-glass)</summary>
        <form onSubmit={(event) => void exchange(event, { admin_token: token.trim() })} autoComplete="off">
          <label htmlFor="admin-token">Admin token</label>
          <input
            id="admin-token"
            name="admin-token"
            type="password"
            autoComplete="off"
            spellCheck={false}
            required
            value={token}
            onChange={(event) => setToken(event.target.value)}
            aria-describedby="admin-token-help"
          />
          <p id="admin-token-help" className="help">
            From <code>MODELFORGE_ADMIN_TOKEN</code> or the file the control plane printed at start
            (<code>modelforge-data/admin-token</code>). For the first users, and when no admin can sign
            in; it is exchanged for a session and not stored.
          </p>
          <button type="submit" className="secondary" disabled={busy}>
            Sign in with the token
          </button>
        </form>
      </details>
      <ErrorNote error={error} />
    </main>
  );
}
