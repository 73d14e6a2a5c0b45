// A real OpenID provider for the tests (npm's oidc-provider, pinned in package.json), on
// loopback: one confidential client, the authorization code flow with PKCE, and people whose
// `groups` claim the control plane maps to roles. Its built-in login and consent pages (dev
// interactions) take any password for a listed person; nobody else exists.
//
// Settings come from the environment: OIDC_PORT, OIDC_CLIENT_ID, OIDC_CLIENT_SECRET,
// OIDC_REDIRECT_URI, OIDC_PEOPLE (JSON: {"<login>": ["<group>", ...]}), OIDC_ID_TOKEN_TTL
// (seconds), OIDC_JWKS (its private signing keys, a JWK set; unset: its own development keys).
// It prints "ready <issuer>" once it listens.
import Provider from "oidc-provider";

const port = Number(process.env.OIDC_PORT);
const issuer = `http://127.0.0.1:${port}`;
const people = JSON.parse(process.env.OIDC_PEOPLE ?? "{}");

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: process.env.OIDC_CLIENT_ID,
      client_secret: process.env.OIDC_CLIENT_SECRET,
      redirect_uris: [process.env.OIDC_REDIRECT_URI],
      grant_types: ["authorization_code"],
      response_types: ["code"],
      token_endpoint_auth_method: "client_secret_basic",
    },
  ],
  pkce: { required: () => true },
  scopes: ["openid", "profile", "groups"],
  claims: { openid: ["sub"], profile: ["preferred_username", "name"], groups: ["groups"] },
  // The claims asked for go into the ID token itself (the control plane reads no userinfo).
  conformIdTokenClaims: false,
  ttl: { IdToken: Number(process.env.OIDC_ID_TOKEN_TTL ?? 3600) },
  ...(process.env.OIDC_JWKS ? { jwks: JSON.parse(process.env.OIDC_JWKS) } : {}),
  async findAccount(_ctx, id) {
    if (!Object.hasOwn(people, id)) return undefined;
    return {
      accountId: id,
      async claims() {
        return { sub: `person-${id}`, preferred_username: id, name: id, groups: people[id] };
      },
    };
  },
  // Dev interactions check no password; a login outside OIDC_PEOPLE has no account.
  features: { devInteractions: { enabled: true } },
});
provider.on("server_error", (_ctx, error) => console.error("server_error", error));

provider.listen(port, "127.0.0.1", () => console.log(`ready ${issuer}`));
