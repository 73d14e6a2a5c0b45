// Sign-in exchanges the admin token for an HttpOnly, SameSite=Strict session cookie; the
// token is never kept by the browser; sign-out ends the session on the server.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import {
  ADMIN_TOKEN,
  BASE_URL,
  assertNowhere,
  browserState,
  entryText,
  launch,
  newPage,
  screenshot,
  signIn,
  useAdminToken,
} from "./helpers.mjs";

let browser;
before(async () => (browser = await launch()));
after(async () => browser?.close());

test("a wrong admin token is refused with its code and next step", async () => {
  const page = await newPage(browser);
  await page.goto(BASE_URL + "/");
  await useAdminToken(page, "mfa_not_the_right_token_at_all");
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
  await page.getByLabel("Name").waitFor();
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

// A person (issue 45): made by the admin token through the API, signed in with a name and
// password, shown by name and role, offered only the screens the role may read, and refused a
// change the role may not make, with the code and the next step.
test("a viewer signs in with a password, sees their role, and is refused a change", async () => {
  const password = "a viewer's long passphrase";
  const made = await fetch(BASE_URL + "/api/v1/users", {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-ModelForge-Admin-Token": ADMIN_TOKEN },
    body: JSON.stringify({ name: "vera", role: "viewer", password }),
  });
  assert.equal(made.status, 201);
  const page = await newPage(browser);
  await page.goto(BASE_URL + "/");
  await page.getByLabel("Name").fill("vera");
  await page.getByLabel("Password").fill("not her password");
  await page.getByRole("button", { name: "Sign in", exact: true }).click();
  assert.match(await page.getByRole("alert").textContent(), /SIGN_IN_FAILED.*Next step:/s);
  assert.equal(await page.getByLabel("Password").inputValue(), "");

  await page.getByLabel("Password").fill(password);
  await page.getByRole("button", { name: "Sign in", exact: true }).click();
  await page.getByRole("heading", { name: "Hardware" }).waitFor();
  assert.equal(await page.locator(".topbar .who").textContent(), "vera (viewer)");
  const nav = page.getByRole("navigation", { name: "Main" });
  assert.equal(await nav.getByRole("link", { name: "Audit" }).count(), 0, "a viewer reads no audit log");
  await nav.getByRole("link", { name: "Jobs" }).waitFor();
  assertNowhere(await browserState(page), password);

  await page.getByRole("button", { name: "Enroll node" }).click();
  const wizard = page.getByRole("dialog", { name: "Enroll node" });
  await wizard.getByLabel("Display name").fill("not-mine");
  await wizard.getByRole("radio", { name: "CPU only" }).check();
  await wizard.getByRole("button", { name: "Next: image" }).click();
  await wizard.getByLabel("Node-agent entry of the release manifest").fill(entryText());
  await wizard.getByRole("button", { name: "Check image" }).click();
  const refused = wizard.getByRole("alert").filter({ hasText: "ROLE_FORBIDDEN" });
  assert.match(await refused.textContent(), /viewer.*Next step:/s);
  await page.context().close();
});
