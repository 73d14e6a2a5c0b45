import { type FormEvent, useState } from "react";
import { ApiError, api, asApiError, type MintedPersonalKey, type PersonalKeyView, type UserView } from "./api";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { when } from "./Labels";
import { ListTable } from "./ListTable";
import { RevealOnce } from "./RevealOnce";
import { usePolled } from "./usePolled";

const ROLES = ["viewer", "member", "operator", "admin"] as const;
const SCOPES = [
  { scope: "read", help: "read what you may read" },
  { scope: "deploy", help: "also submit jobs and deploy services" },
  { scope: "admin", help: "everything you may do, minting keys included" },
] as const;

// People (docs/access.md): who you are and your personal API keys; for admins, the users and
// their roles. What a role may not do the API refuses (ROLE_FORBIDDEN), shown where it was asked.
export function People() {
  const me = usePolled(api.me, null);
  const admin = me.data?.may.includes("people:change") ?? false;
  return (
    <>
      <h1>People</h1>
      <ErrorNote error={me.error} />
      {me.data && (
        <p data-testid="who-am-i">
          Signed in as <strong>{me.data.user ?? "the admin token (break-glass)"}</strong>, role{" "}
          <strong>{me.data.role}</strong>: may {me.data.may.join(", ")}.
        </p>
      )}
      {me.data?.user && <MyKeys />}
      {admin && <Users />}
    </>
  );
}

function MyKeys() {
  const keys = usePolled(api.myKeys, [] as PersonalKeyView[]);
  const [minted, setMinted] = useState<MintedPersonalKey | null>(null);
  const [revoking, setRevoking] = useState<PersonalKeyView | null>(null);
  const [failure, setFailure] = useState<ApiError | null>(null);

  async function revoke(key: PersonalKeyView) {
    setRevoking(null);
    setFailure(null);
    try {
      await api.revokeKey(key.id);
      await keys.reload();
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <section aria-labelledby="keys-heading">
      <h2 id="keys-heading">My API keys</h2>
      <p className="help">
        A key acts as you, within its scopes and never beyond your role; send it as <code>Authorization: Bearer</code>.
      </p>
      <MintKeyForm
        onMinted={(key) => {
          setMinted(key);
          void keys.reload();
        }}
      />
      {minted && (
        <RevealOnce
          title={`API key ${minted.name}`}
          label="API key"
          what="Key"
          hint={minted.hint}
          secret={minted.key}
          testId="personal-key"
          onHide={() => setMinted(null)}
        />
      )}
      <ErrorNote error={failure ?? keys.error} />
      <ListTable
        caption={<>My keys</>}
        columns={["Name", "Hint", "Scopes", "Expires", ""]}
        loaded={keys.loaded}
        empty="No keys yet."
        rows={keys.data}
        row={(key) => (
          <tr key={key.id}>
            <td>{key.name}</td>
            <td>
              <code>{key.hint}…</code>
            </td>
            <td>{key.scopes.join(", ")}</td>
            <td>{when(key.expires_at)}</td>
            <td>
              <button type="button" className="danger" aria-label={`Revoke key ${key.name}`} onClick={() => setRevoking(key)}>
                Revoke
              </button>
            </td>
          </tr>
        )}
      />
      {revoking && (
        <Confirm
          title={`Revoke key ${revoking.name}?`}
          action="Revoke key"
          onConfirm={() => void revoke(revoking)}
          onCancel={() => setRevoking(null)}
        >
          <p>
            Scripts using <code>{revoking.hint}…</code> are refused from their next request. This cannot be undone.
          </p>
        </Confirm>
      )}
    </section>
  );
}

function MintKeyForm({ onMinted }: { onMinted: (key: MintedPersonalKey) => void }) {
  const [name, setName] = useState("");
  const [scopes, setScopes] = useState<string[]>(["read"]);
  const [days, setDays] = useState("90");
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function mint(event: FormEvent) {
    event.preventDefault();
    setBusy(true);
    setError(null);
    try {
      onMinted(await api.mintKey({ name: name.trim(), scopes, expires_in_days: Number(days) }));
      setName("");
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  return (
    <form className="details" aria-labelledby="mint-key-heading" onSubmit={(event) => void mint(event)}>
      <h3 id="mint-key-heading">Mint a key</h3>
      <label htmlFor="key-name">Key name (where it is used)</label>
      <input id="key-name" required maxLength={100} value={name} onChange={(event) => setName(event.target.value)} />
      <fieldset>
        <legend>Scopes</legend>
        {SCOPES.map(({ scope, help }) => (
          <label key={scope} className="choice">
            <input
              type="checkbox"
              checked={scopes.includes(scope)}
              onChange={(event) =>
                setScopes(event.target.checked ? [...scopes, scope] : scopes.filter((held) => held !== scope))
              }
            />{" "}
            {scope} ({help})
          </label>
        ))}
      </fieldset>
      <label htmlFor="key-days">Expires after (days, 1 to 366)</label>
      <input id="key-days" type="number" min="1" max="366" required value={days} onChange={(event) => setDays(event.target.value)} />
      <ErrorNote error={error} />
      <div className="actions">
        <button type="submit" disabled={busy}>
          {busy ? "Minting…" : "Mint key"}
        </button>
      </div>
    </form>
  );
}

function Users() {
  const users = usePolled(api.users, [] as UserView[]);
  const [removing, setRemoving] = useState<UserView | null>(null);
  const [failure, setFailure] = useState<ApiError | null>(null);

  async function change(action: () => Promise<unknown>) {
    setFailure(null);
    try {
      await action();
      await users.reload();
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <section aria-labelledby="users-heading">
      <h2 id="users-heading">Users</h2>
      <AddUserForm onAdded={() => void users.reload()} />
      <ErrorNote error={failure ?? users.error} />
      <ListTable
        caption={<>Users and their roles</>}
        columns={["Name", "Role", "Signs in with", "State", "Created", ""]}
        loaded={users.loaded}
        empty="No users yet: add one above."
        rows={users.data}
        row={(user) => (
          <tr key={user.id} data-user={user.name}>
            <td>{user.name}</td>
            <td>
              <select
                aria-label={`Role of ${user.name}`}
                value={user.role}
                onChange={(event) => void change(() => api.updateUser(user.name, { role: event.target.value }))}
              >
                {ROLES.map((role) => (
                  <option key={role}>{role}</option>
                ))}
              </select>
            </td>
            <td>{user.created_by === "oidc" ? "single sign-on" : user.has_password ? "password" : "nothing yet"}</td>
            <td>{user.disabled ? <span className="badge revoked">disabled</span> : "enabled"}</td>
            <td>{when(user.created_at)}</td>
            <td className="actions start">
              <button
                type="button"
                className="secondary"
                onClick={() => void change(() => api.updateUser(user.name, { disabled: !user.disabled }))}
              >
                {user.disabled ? `Enable ${user.name}` : `Disable ${user.name}`}
              </button>
              <button type="button" className="danger" onClick={() => setRemoving(user)}>
                Remove {user.name}
              </button>
            </td>
          </tr>
        )}
      />
      {removing && (
        <Confirm
          title={`Remove ${removing.name}?`}
          action="Remove user"
          onConfirm={() => {
            const user = removing;
            setRemoving(null);
            void change(() => api.deleteUser(user.name));
          }}
          onCancel={() => setRemoving(null)}
        >
          <p>Their keys and sessions stop at once; the audit log keeps their name.</p>
        </Confirm>
      )}
    </section>
  );
}

function AddUserForm({ onAdded }: { onAdded: () => void }) {
  const [name, setName] = useState("");
  const [role, setRole] = useState<string>("member");
  const [password, setPassword] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function add(event: FormEvent) {
    event.preventDefault();
    setBusy(true);
    setError(null);
    try {
      await api.createUser({ name: name.trim(), role, ...(password ? { password } : {}) });
      setName("");
      onAdded();
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setPassword("");
      setBusy(false);
    }
  }

  return (
    <form className="details" aria-labelledby="add-user-heading" onSubmit={(event) => void add(event)}>
      <h3 id="add-user-heading">Add a user</h3>
      <div className="row">
        <div>
          <label htmlFor="user-new-name">Name</label>
          <input id="user-new-name" required maxLength={32} value={name} onChange={(event) => setName(event.target.value)} />
        </div>
        <div>
          <label htmlFor="user-new-role">Role</label>
          <select id="user-new-role" value={role} onChange={(event) => setRole(event.target.value)}>
            {ROLES.map((choice) => (
              <option key={choice}>{choice}</option>
            ))}
          </select>
        </div>
        <div>
          <label htmlFor="user-new-password">Password (12 characters or more; optional)</label>
          <input
            id="user-new-password"
            type="password"
            autoComplete="new-password"
            value={password}
            onChange={(event) => setPassword(event.target.value)}
          />
        </div>
      </div>
      <ErrorNote error={error} />
      <div className="actions">
        <button type="submit" disabled={busy}>
          {busy ? "Adding…" : "Add user"}
        </button>
      </div>
    </form>
  );
}
