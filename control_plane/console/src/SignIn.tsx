import { type FormEvent, useState } from "react";
import { type ApiError, asApiError, signIn } from "./api";
import { ErrorNote } from "./ErrorNote";

// The admin token is exchanged for a session cookie. It stays in this form's state only
// until the exchange answers, and the field is cleared either way.
export function SignIn({ notice, onSignedIn }: { notice: string | null; onSignedIn: () => void }) {
  const [token, setToken] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function submit(event: FormEvent) {
    event.preventDefault();
    setBusy(true);
    setError(null);
    try {
      await signIn(token.trim());
      setToken("");
      onSignedIn();
    } catch (caught) {
      setToken("");
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  return (
    <main className="signin">
      <h1>ModelForge console</h1>
      {notice && <p role="status">{notice}</p>}
      <form onSubmit={submit} autoComplete="off">
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
          (<code>modelforge-data/admin-token</code>). It is exchanged for a session and not stored.
        </p>
        <button type="submit" disabled={busy}>
          Sign in
        </button>
      </form>
      <ErrorNote error={error} />
    </main>
  );
}
