import { type FormEvent, useState } from "react";
import { type AccessTokenView, ApiError, api, asApiError, type MintedAccessToken, type ServiceView } from "./api";
import { Confirm } from "./Confirm";
import { CopyButton } from "./enroll/CommandBox";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { when } from "./Labels";
import { ListTable } from "./ListTable";
import { LLM_RUNNERS } from "./ServiceLlm";
import { RevealOnce } from "./RevealOnce";
import { usePolled } from "./usePolled";

const REFRESH_MS = 10_000;

// Where clients reach the service: the control plane's own origin (the gateway), never a node.
// The example carries a placeholder, never a token.
export function GatewayAddress({ service }: { service: ServiceView }) {
  const origin = window.location.origin;
  const name = encodeURIComponent(service.name);
  const command = service.command !== null && service.runner === null;
  if (service.runner !== null && LLM_RUNNERS.includes(service.runner)) return <LlmAddress service={service} />;
  const address = command ? `${origin}/services/${name}/` : `${origin}/v2/models/${name}`;
  const example = command
    ? `TOKEN=mfs_…   # an access token of ${service.name} (Access tokens, below)\n` +
      `curl -s "${address}" -H "Authorization: Bearer $TOKEN"`
    : `TOKEN=mfs_…   # an access token of ${service.name} (Access tokens, below)\n` +
      `curl -s "${address}" -H "Authorization: Bearer $TOKEN"   # its metadata\n` +
      `curl -s "${address}/infer" -H "Authorization: Bearer $TOKEN" \\\n` +
      `  -H 'Content-Type: application/json' -d '{"inputs": [...]}'`;
  return (
    <section aria-labelledby="gateway-heading">
      <h2 id="gateway-heading">Gateway address</h2>
      <p>
        Clients call the service at <code data-testid="gateway-address">{address}</code>
        {command ? " (any method and path below it)" : " (Open Inference Protocol v2)"}, with one of its access
        tokens. Prefer it to a replica's URL: it reaches every healthy replica and stays the same when replicas move.
      </p>
      <label htmlFor="gateway-example">Example (set TOKEN to a token minted below)</label>
      <textarea id="gateway-example" readOnly rows={command ? 2 : 4} value={example} spellCheck={false} />
      <CopyButton text={example} label="Copy example" />
    </section>
  );
}

// An LLM service's address: the OpenAI API at the control plane's origin, its name the model.
function LlmAddress({ service }: { service: ServiceView }) {
  const address = `${window.location.origin}/v1`;
  const example =
    `KEY=mfs_…   # an access token of ${service.name} (Access tokens, below)\n` +
    `curl -sN "${address}/chat/completions" -H "Authorization: Bearer $KEY" \\\n` +
    `  -H 'Content-Type: application/json' \\\n` +
    `  -d '{"model": ${JSON.stringify(service.name)}, "stream": true, "messages": [{"role": "user", "content": "Hello!"}]}'`;
  return (
    <section aria-labelledby="gateway-heading">
      <h2 id="gateway-heading">Gateway address</h2>
      <p>
        Clients call the model with any OpenAI client at <code data-testid="gateway-address">{address}</code>, model{" "}
        <code>{service.name}</code>
        {service.aliases?.length ? (
          <span data-testid="service-aliases">
            {" "}
            (or {service.aliases.map((alias, index) => (
              <span key={alias}>
                {index > 0 && ", "}
                <code>{alias}</code>
              </span>
            ))}
            )
          </span>
        ) : null}
        , with one of its access tokens as the API key.
      </p>
      <label htmlFor="gateway-example">Example (set KEY to a token minted below)</label>
      <textarea id="gateway-example" readOnly rows={4} value={example} spellCheck={false} />
      <CopyButton text={example} label="Copy example" />
    </section>
  );
}

// A service's access tokens: mint one (shown once, with a copy button), list them by hint, and
// revoke one after a confirmation.
export function ServiceTokens({ serviceId, deployed }: { serviceId: string; deployed: boolean }) {
  const tokens = usePolled(api.accessTokens(serviceId), [] as AccessTokenView[], REFRESH_MS);
  const [minting, setMinting] = useState(false);
  const [minted, setMinted] = useState<MintedAccessToken | null>(null);
  const [revoking, setRevoking] = useState<AccessTokenView | null>(null);
  const [failure, setFailure] = useState<ApiError | null>(null);


  async function revoke(token: AccessTokenView) {
    setRevoking(null);
    setFailure(null);
    try {
      await api.revokeAccessToken(serviceId, token.id);
      await tokens.reload();
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <section aria-labelledby="tokens-heading">
      <div className="title-row">
        <h2 id="tokens-heading">Access tokens</h2>
        {deployed && (
          <button type="button" onClick={() => setMinting(true)} disabled={minting || minted !== null}>
            Mint token
          </button>
        )}
      </div>
      {minting && (
        <MintForm
          serviceId={serviceId}
          onClose={() => setMinting(false)}
          onMinted={(token) => {
            setMinting(false);
            setMinted(token);
            void tokens.reload();
          }}
        />
      )}
      {minted && (
        <RevealOnce
          title={`Access token ${minted.name}`}
          label="Access token"
          what="Token"
          hint={minted.hint}
          secret={minted.token}
          testId="access-token"
          onHide={() => setMinted(null)}
        />
      )}
      <ErrorNote error={failure ?? tokens.error} />
      <ListTable
        caption={<>Tokens, newest first: a client sends one as Authorization: Bearer</>}
        columns={["Name", "Hint", "Rate", "Created", "Last used", "State", ""]}
        loaded={tokens.loaded}
        empty={deployed ? "No tokens yet: use Mint token." : "No tokens."}
        rows={tokens.data}
        row={(token) => (
          <tr key={token.id} data-token-id={token.id}>
            <td>{token.name}</td>
            <td>
              <code data-testid="token-hint">{token.hint}…</code>
            </td>
            <td>
              {token.rate_per_second === null ? "unlimited" : `${token.rate_per_second}/s, burst ${token.burst}`}
              {token.tokens_per_minute !== null && `; ${token.tokens_per_minute} tokens/min`}
            </td>
            <td>{when(token.created_at)}</td>
            <td>{token.last_used_at ? ago(token.last_used_at) : "never"}</td>
            <td data-testid="token-state">
              {token.revoked_at ? <span className="badge revoked">revoked {ago(token.revoked_at)}</span> : "active"}
            </td>
            <td>
              {!token.revoked_at && (
                <button
                  type="button"
                  className="danger"
                  aria-label={`Revoke token ${token.name}`}
                  onClick={() => setRevoking(token)}
                >
                  Revoke
                </button>
              )}
            </td>
          </tr>
        )}
      />
      {revoking && (
        <Confirm
          title={`Revoke token ${revoking.name}?`}
          action="Revoke token"
          onConfirm={() => void revoke(revoking)}
          onCancel={() => setRevoking(null)}
        >
          <p>
            Clients using <code>{revoking.hint}…</code> are refused within a second. This cannot be undone: mint a new
            token for them.
          </p>
        </Confirm>
      )}
    </section>
  );
}

function MintForm(props: { serviceId: string; onClose: () => void; onMinted: (token: MintedAccessToken) => void }) {
  const [name, setName] = useState("");
  const [rate, setRate] = useState("");
  const [burst, setBurst] = useState("");
  const [perMinute, setPerMinute] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function mint(event: FormEvent) {
    event.preventDefault();
    if (burst.trim() && !rate.trim()) {
      setError(new ApiError(0, "BURST_WITHOUT_RATE", "A burst needs a rate.", "Give a rate per second, or leave burst empty."));
      return;
    }
    setBusy(true);
    setError(null);
    try {
      props.onMinted(
        await api.mintAccessToken(props.serviceId, {
          name: name.trim(),
          rate_per_second: rate.trim() ? Number(rate) : null,
          burst: burst.trim() ? Number(burst) : null,
          tokens_per_minute: perMinute.trim() ? Number(perMinute) : null,
        }),
      );
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  return (
    <form className="details" aria-labelledby="mint-heading" onSubmit={(event) => void mint(event)}>
      <h3 id="mint-heading">Mint an access token</h3>
      <label htmlFor="token-name">Token name (who uses it)</label>
      <input id="token-name" required maxLength={100} value={name} onChange={(event) => setName(event.target.value)} />
      <div className="row">
        <div>
          <label htmlFor="token-rate">Requests per second (optional)</label>
          <input id="token-rate" type="number" min="0" step="any" value={rate} onChange={(event) => setRate(event.target.value)} />
        </div>
        <div>
          <label htmlFor="token-burst">Burst (optional)</label>
          <input id="token-burst" type="number" min="1" step="1" value={burst} onChange={(event) => setBurst(event.target.value)} />
        </div>
        <div>
          <label htmlFor="token-per-minute">LLM tokens per minute (optional)</label>
          <input
            id="token-per-minute"
            type="number"
            min="1"
            step="1"
            value={perMinute}
            onChange={(event) => setPerMinute(event.target.value)}
          />
        </div>
      </div>
      <p className="help">
        No rate: unlimited. Burst defaults to a second's worth. Tokens per minute limits an LLM service's OpenAI calls
        (prompt and completion). Each control-plane process counts its own.
      </p>
      <ErrorNote error={error} />
      <div className="actions">
        <button type="button" className="secondary" onClick={props.onClose}>
          Close
        </button>
        <button type="submit" disabled={busy}>
          {busy ? "Minting…" : "Mint"}
        </button>
      </div>
    </form>
  );
}
