// Sign-in exchanges the admin token for an HttpOnly, SameSite=Strict session cookie; the
// token is never kept by the browser; sign-out ends the session on the server.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { ADMIN_TOKEN, BASE_URL, assertNowhere, browserState, launch, newPage, screenshot, signIn } from "./helpers.mjs";

let browser;
before(async () => (browser = await launch()));
after(async () => browser?.close());

test("a wrong admin token is refused with its code and next step", async () => {
  const page = await newPage(browser);
  await page.goto(BASE_URL + "/");
  await page.getByLabel("Admin token").fill("mfa_not_the_right_token_at_all");
  await page.getByRole("button", { name: "Sign in" }).click();
  const alert = page.getByRole("alert");
  await alert.waitFor();
  assert.match(await alert.textContent(), /ADMIN_TOKEN_INVALID.*Next step:/s);
  assert.equal(await page.getByLabel("Admin token").inputValue(), "");
  assert.equal((await page.context().cookies()).length, 0);
  await page.context().close();
});

test("sign in, the session cookie, and a server-side sign-out", async () => {
  const page = await newPage(browser);
  await page.goto(BASE_URL + "/");
  await screenshot(page, "sign-in");
  await signIn(page);

  const [cookie, ...others] = await page.context().cookies();
  assert.equal(others.length, 0);
  assert.equal(cookie.name, "modelforge_session");
  assert.equal(cookie.httpOnly, true);
  assert.equal(cookie.sameSite, "Strict");
  assert.ok(cookie.expires > Date.now() / 1000, "a session cookie with an expiry");
  assert.equal(await page.evaluate(() => document.cookie), "", "scripts cannot read the session");
  assertNowhere(await browserState(page), ADMIN_TOKEN);

  // The session survives a reload (the CSRF token is recovered from the cookie, not storage).
  await page.reload();
  await page.getByRole("heading", { name: "Hardware" }).waitFor();

  await page.getByRole("button", { name: "Sign out" }).click();
  await page.getByLabel("Admin token").waitFor();
  // The old cookie value is dead on the server, not merely forgotten by the browser.
  const replay = await fetch(BASE_URL + "/api/v1/admin/nodes", {
    headers: { Cookie: `modelforge_session=${cookie.value}` },
  });
  assert.equal(replay.status, 401);
  assert.equal((await replay.json()).error.code, "SESSION_INVALID");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("a change with the cookie but without the CSRF token is refused", async () => {
  const page = await newPage(browser);
  await signIn(page);
  const result = await page.evaluate(async () => {
    const response = await fetch("/api/v1/admin/node-enrollments", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ display_name: "forged", expires_in_seconds: 300 }),
    });
    return { status: response.status, body: await response.json() };
  });
  assert.equal(result.status, 403);
  assert.equal(result.body.error.code, "CSRF_TOKEN_MISSING");
  await page.context().close();
});
