// Single sign-on in Chromium (issue 45), run by tests/e2e/test_sso.py against a control plane
// configured for a real OpenID provider on loopback (tests/oidc-provider.mjs): the console's
// button, the provider's own login and consent pages, its redirect back, the person signed in
// with the role their groups map to, and a sign-out that ends the session on the server. Not a
// *.test.mjs file: the console's main browser run has no provider.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { BASE_URL, launch, newPage, screenshot } from "./helpers.mjs";

let browser;
before(async () => (browser = await launch()));
after(async () => browser?.close());

test("a person signs in through the provider, lands with their mapped role, and signs out", async () => {
  const page = await newPage(browser);
  await page.goto(BASE_URL + "/");
  const button = page.getByRole("link", { name: "Sign in with Example SSO" });
  await button.waitFor();
  await screenshot(page, "sign-in-sso");
  await button.click();

  // The provider's pages, at its own address.
  await page.waitForURL((url) => url.origin !== new URL(BASE_URL).origin);
  await page.locator('input[name="login"]').fill("olga");
  await page.locator('input[name="password"]').fill("her provider password");
  await page.getByRole("button", { name: "Sign-in" }).click();
  await page.getByRole("button", { name: "Continue" }).click();

  // Back at the console, signed in as her, with the highest role her groups map to.
  await page.getByRole("heading", { name: "Hardware" }).waitFor();
  assert.equal(new URL(page.url()).origin, new URL(BASE_URL).origin);
  assert.equal(await page.locator(".topbar .who").textContent(), "olga (operator)");
  const nav = page.getByRole("navigation", { name: "Main" });
  await nav.getByRole("link", { name: "Audit" }).waitFor(); // operators read the audit log

  const cookie = (await page.context().cookies()).find((c) => c.name === "modelforge_session");
  assert.ok(cookie?.httpOnly, "an HttpOnly session cookie");
  assert.equal(cookie.sameSite, "Strict");
  assert.equal(
    (await page.context().cookies()).find((c) => c.name === "modelforge_oidc"),
    undefined,
    "the sign-in's verifier cookie is gone once used",
  );

  await page.getByRole("button", { name: "Sign out" }).click();
  await page.getByRole("link", { name: "Sign in with Example SSO" }).waitFor();
  const replay = await fetch(BASE_URL + "/api/v1/me", {
    headers: { Cookie: `modelforge_session=${cookie.value}` },
  });
  assert.equal(replay.status, 401, "the session ended on the server");
  await page.context().close();
});
