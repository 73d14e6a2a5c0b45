// The Nodes screen shows labels, Needs upgrade and the duplicate-identity flag. The two
// nodes here enroll through the real agent API with one machine ID, and one then heartbeats
// with a protocol this control plane does not speak.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { BASE_URL, admin, claim, launch, newPage, signIn } from "./helpers.mjs";

let browser;
before(async () => (browser = await launch()));
after(async () => browser?.close());

async function enrollProbe(name, machineId) {
  const minted = await admin("POST", "/api/v1/admin/node-enrollments", {
    display_name: name,
    expires_in_seconds: 300,
    labels: { zone: "lab-7" },
  });
  assert.equal(minted.status, 201);
  const claimed = await claim(minted.body.token, { fingerprint: { machine_id: machineId } });
  assert.equal(claimed.status, 200, JSON.stringify(claimed.body));
  return claimed.body;
}

test("labels, Needs upgrade and Duplicate identity are flagged on the Nodes screen", async () => {
  const machineId = "cloned-machine-" + Date.now();
  const first = await enrollProbe("clone-a", machineId);
  const second = await enrollProbe("clone-b", machineId);
  const refused = await fetch(BASE_URL + "/api/v1/agent/heartbeat", {
    method: "POST",
    headers: { Authorization: `Bearer ${first.credential}`, "Content-Type": "application/json" },
    body: JSON.stringify({ protocol_version: 99, agent_version: "9.0.0", health: { status: "healthy", preflight: "passed" } }),
  });
  assert.equal(refused.status, 426);

  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Nodes" }).click();
  const rowA = page.locator(`tr[data-node-id="${first.node_id}"]`);
  const rowB = page.locator(`tr[data-node-id="${second.node_id}"]`);
  await rowA.waitFor();
  assert.match(await rowA.textContent(), /Needs upgrade \(agent\)/);
  for (const row of [rowA, rowB]) {
    assert.match(await row.textContent(), /Duplicate identity/);
    assert.match(await row.textContent(), /zone=lab-7/);
  }
  assert.doesNotMatch(await rowB.textContent(), /Needs upgrade/);
  await rowA.getByRole("button", { name: /Details/ }).click();
  await page.getByText(/Needs upgrade: TOO_NEW/).waitFor();
  await page.locator("ul.events li", { hasText: "duplicate_identity" }).or(page.locator("ul.events li", { hasText: "needs_upgrade" })).first().waitFor();
  await page.context().close();
});
