// A service's page with replicas, its gateway address, traffic and access tokens (issue 27),
// against a real control plane with a real CPU node (node agent and runtime worker as
// processes; the gateway reaches the replicas through the tunnel the agent opened): two replicas
// of a command service, a token minted and shown once, requests through the gateway with it
// counted in the Traffic panel, the list showing its hint only, and the token revoked (confirmed)
// and refused by the gateway.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { BASE_URL, WORKDIR, admin, assertNowhere, browserState, launch, newPage, screenshot, signIn, startNode, until } from "./helpers.mjs";

const POOL = { pool: "console-gateway" };
let browser;
let node;
let nodeId;

before(async () => {
  browser = await launch();
  const minted = await admin("POST", "/api/v1/admin/node-enrollments", {
    display_name: "gateway-node",
    expires_in_seconds: 900,
    labels: POOL,
  });
  assert.equal(minted.status, 201, JSON.stringify(minted.body));
  nodeId = minted.body.node_id;
  node = startNode("gateway-node", minted.body.token);
  await until("the gateway node to be online with its inventory", async () => {
    const view = (await admin("GET", `/api/v1/admin/nodes/${nodeId}`)).body;
    return view?.state === "online" && view.inventory ? view : null;
  });
});

after(async () => {
  node?.stop();
  await browser?.close();
});

test("replicas, the gateway address and traffic; a token minted once, used, listed by hint, revoked", async () => {
  const site = join(WORKDIR, "gateway-site-" + randomBytes(4).toString("hex"));
  mkdirSync(site);
  writeFileSync(join(site, "hello.txt"), "hello through the gateway\n");
  const deployed = await admin("POST", "/api/v1/services", {
    name: "console-gw",
    command: ["python3", "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", site],
    labels: POOL,
    resources: { cpus: 0.25 },
    replicas: 2,
  });
  assert.equal(deployed.status, 201, JSON.stringify(deployed.body));
  const serviceId = deployed.body.service_id;

  const page = await newPage(browser);
  await signIn(page);
  await page.goto(`${BASE_URL}/services/${serviceId}`);
  await page.getByRole("heading", { name: "Service console-gw" }).waitFor();

  // Replicas: a row each, both healthy on the node, with revision and restarts.
  await page.getByTestId("replicas-summary").filter({ hasText: "2 of 2 replicas healthy" }).waitFor({ timeout: 90_000 });
  const rows = page.locator("tr[data-replica-id]");
  assert.equal(await rows.count(), 2);
  for (const [index, ordinal] of [0, 1].entries()) {
    const text = await rows.nth(index).textContent();
    assert.match(text, new RegExp(`#${ordinal}`));
    assert.match(text, new RegExp(nodeId));
    assert.equal(await rows.nth(index).getByTestId("replica-state").textContent(), "healthy");
    assert.equal(await rows.nth(index).getByTestId("replica-restarts").textContent(), "0");
  }
  await page.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor();

  // The gateway address is the control plane's own, with a placeholder in the example.
  const address = `${BASE_URL}/services/console-gw/`;
  assert.equal(await page.getByTestId("gateway-address").textContent(), address);
  const example = await page.getByLabel(/^Example/).inputValue();
  assert.ok(example.includes(`curl -s "${address}" -H "Authorization: Bearer $TOKEN"`), example);

  // Mint: the token is shown once, with the warning and a copy button.
  await page.getByRole("button", { name: "Mint token" }).click();
  await page.getByLabel("Token name (who uses it)").fill("checkout app");
  await page.getByLabel("Requests per second (optional)").fill("50");
  await page.getByRole("button", { name: "Mint", exact: true }).click();
  const shown = page.getByTestId("access-token");
  await shown.waitFor();
  const token = (await shown.textContent()).trim();
  assert.match(token, /^mfs_[A-Za-z0-9_-]{43}$/);
  assert.match(await page.locator(".token-box").textContent(), /you will not see it again/);
  await page.getByRole("button", { name: "Copy token" }).waitFor();
  await page.locator("tr[data-token-id]", { hasText: "checkout app" }).waitFor();
  await page.getByRole("heading", { name: "Access tokens" }).evaluate((heading) => heading.scrollIntoView());
  await screenshot(page, "service-token");

  // The token opens the service at the gateway, through the node's tunnel, to either replica.
  const bearer = { Authorization: `Bearer ${token}` };
  for (let i = 0; i < 4; i += 1) {
    const answer = await until("the gateway to answer through the tunnel", async () => {
      const response = await fetch(address + "hello.txt", { headers: bearer });
      return response.status === 200 ? response : null;
    }, 30_000);
    assert.equal(await answer.text(), "hello through the gateway\n");
  }
  assert.equal((await fetch(address + "hello.txt")).status, 401, "no token: refused");

  // Traffic: the requests counted for this service.
  await page.getByTestId("traffic-total").filter({ hasText: /200: [4-9]/ }).waitFor({ timeout: 15_000 });
  await page.getByTestId("traffic-rate").filter({ hasText: /^\d/ }).waitFor({ timeout: 15_000 });
  assert.match(await page.getByTestId("traffic-now").textContent(), /^\d+ · \d+$/);

  // Hidden: the token is nowhere in the page or the browser; the list shows its hint only.
  await page.getByRole("button", { name: "I have kept it: hide the token" }).click();
  await shown.waitFor({ state: "detached" });
  const row = page.locator("tr[data-token-id]", { hasText: "checkout app" });
  await row.waitFor();
  assert.equal(await row.getByTestId("token-hint").textContent(), token.slice(0, 10) + "…");
  assert.match(await row.textContent(), /50\/s/);
  assert.equal(await row.getByTestId("token-state").textContent(), "active");
  assertNowhere(await browserState(page), token);
  await page.getByRole("heading", { name: "Gateway address" }).evaluate((heading) => heading.scrollIntoView());
  await screenshot(page, "service-gateway");

  // Revoke: Cancel changes nothing; confirmed, the list says revoked and the gateway refuses it.
  await row.getByRole("button", { name: "Revoke token checkout app" }).click();
  const dialog = page.getByRole("dialog", { name: "Revoke token checkout app?" });
  await dialog.getByRole("button", { name: "Cancel", exact: true }).click();
  const listed = (await admin("GET", `/api/v1/services/${serviceId}/access-tokens`)).body;
  assert.equal(listed.length, 1);
  assert.equal(listed[0].revoked_at, null);
  assert.equal(JSON.stringify(listed).includes(token), false);
  await row.getByRole("button", { name: "Revoke token checkout app" }).click();
  await dialog.getByRole("button", { name: "Revoke token" }).click();
  await row.getByTestId("token-state").filter({ hasText: "revoked" }).waitFor({ timeout: 10_000 });
  assert.equal(await row.getByRole("button", { name: /Revoke/ }).count(), 0);
  await until("the gateway to refuse the revoked token", async () => (await fetch(address + "hello.txt", { headers: bearer })).status === 401, 5_000);
  assert.equal((await admin("GET", "/api/v1/admin/audit?action=service_token.revoke")).body.length, 1);

  // The list: the service with its replicas counted.
  await page.getByRole("link", { name: "← Services" }).click();
  const listRow = page.locator(`tr[data-service-id="${serviceId}"]`);
  await listRow.getByTestId("service-replicas").filter({ hasText: "2/2" }).waitFor();

  assert.equal((await admin("DELETE", `/api/v1/services/${serviceId}`)).status, 200);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});
