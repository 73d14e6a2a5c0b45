// The full path in the browser: enroll with the wizard, start a real node agent (CPU mode) with
// the revealed token, Check node readiness until every check passes, see it online on Nodes with
// its events, and revoke its credential with a confirmation. A second node (NVIDIA mode over the
// substitute NVML library) shows GPU telemetry charts.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { admin, assertNowhere, browserState, launch, newPage, openWizardToToken, screenshot, signIn, startNode } from "./helpers.mjs";

let browser;
const nodes = [];
before(async () => (browser = await launch()));
after(async () => {
  for (const node of nodes) node.stop();
  await browser?.close();
});

async function readyViaWizard(page, wizard) {
  const deadline = Date.now() + 60_000;
  for (;;) {
    await wizard.getByRole("button", { name: "Check node readiness" }).last().click();
    const verdict = wizard.getByTestId("readiness-verdict");
    try {
      await verdict.waitFor({ timeout: 2000 });
      if ((await verdict.textContent()).startsWith("Ready")) return;
    } catch {
      // not enrolled yet: the wizard says so; ask again
    }
    assert.ok(Date.now() < deadline, "the node never became ready: " + (await wizard.textContent()));
    await page.waitForTimeout(1000);
  }
}

test("enroll, start a CPU node agent with the revealed token, readiness, nodes screen", async () => {
  const page = await newPage(browser);
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "cpu-node-1", expiry: "15 min" });
  const token = await wizard.getByTestId("enrollment-token").textContent();
  const nodeId = await wizard.getByTestId("node-id").textContent();
  const node = startNode("cpu-node-1", token);
  nodes.push(node);

  // Checking readiness clears the reveal; readiness is tied to this enrollment's node id.
  await readyViaWizard(page, wizard);
  assertNowhere(await browserState(page), token);
  const checks = await wizard.locator("tr[data-check]").evaluateAll((rows) =>
    rows.map((row) => [row.dataset.check, row.querySelector(".badge").textContent]),
  );
  assert.ok(checks.length >= 5, JSON.stringify(checks));
  assert.deepEqual(checks.filter(([, status]) => status !== "pass"), []);
  assert.match(await wizard.textContent(), new RegExp(`Readiness of node ${nodeId}`));
  const recreate = await wizard.getByLabel(/Container recreation command/).inputValue();
  assert.match(recreate, /--force-recreate/);
  assert.ok(!recreate.includes(token));
  await screenshot(page, "wizard-readiness");
  await wizard.getByRole("button", { name: "Close" }).click();

  await page.getByRole("link", { name: "Nodes" }).click();
  const row = page.locator(`tr[data-node-id="${nodeId}"]`);
  await row.getByTestId("node-state").filter({ hasText: "online" }).waitFor({ timeout: 20_000 });
  // Its free capacity, as GET /api/v1/admin/resources counts it (nothing runs: all of it), and
  // the fleet's free capacity above the list.
  const resources = await admin("GET", "/api/v1/admin/resources");
  assert.equal(resources.status, 200, JSON.stringify(resources.body));
  const capacity = resources.body.nodes.find((n) => n.node_id === nodeId).capacity;
  assert.deepEqual(capacity.free, capacity.total);
  const cpus = `${capacity.free.cpus} of ${capacity.total.cpus} CPUs`;
  await row.getByTestId("node-free").filter({ hasText: cpus }).waitFor({ timeout: 10_000 });
  assert.match(await row.getByTestId("node-free").textContent(), /0 of 0 GPUs.*0 jobs running/);
  const fleet = resources.body.fleet.schedulable;
  const fleetCpus = `Free on schedulable nodes: ${fleet.free.cpus} of ${fleet.total.cpus} CPUs`;
  await page.getByTestId("fleet-free").filter({ hasText: fleetCpus }).waitFor({ timeout: 10_000 });
  await row.getByRole("button", { name: /Details/ }).click();
  await page.getByRole("heading", { name: /Events/ }).waitFor();
  await page.getByText("Nothing runs here: all of it is free.").waitFor();
  await page.locator("ul.events li", { hasText: "enrolled" }).first().waitFor({ timeout: 10_000 });
  await page.getByRole("img", { name: /Host CPU/ }).waitFor();
  await screenshot(page, "nodes-cpu");

  // Revoke the credential, with confirmation: Cancel changes nothing, Revoke stops the agent.
  await page.getByRole("button", { name: "Revoke credential" }).click();
  const confirm = page.getByRole("dialog", { name: /Revoke the credential of cpu-node-1/ });
  await confirm.getByRole("button", { name: "Cancel" }).click();
  assert.equal((await admin("GET", `/api/v1/admin/nodes/${nodeId}/events`)).body.filter((e) => e.kind === "credential_revoked").length, 0);
  await page.getByRole("button", { name: "Revoke credential" }).click();
  await page.getByRole("dialog", { name: /Revoke the credential/ }).getByRole("button", { name: "Revoke credential" }).click();
  await page.getByRole("status").filter({ hasText: "1 credential(s) revoked" }).waitFor();
  const code = await Promise.race([node.exited, new Promise((r) => setTimeout(() => r("still running"), 30_000))]);
  assert.equal(code, 4, "the agent stops with exit code 4 (credential) once revoked:\n" + node.log());
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("an NVIDIA node's GPUs show live utilisation and memory charts", async () => {
  const nvmlDir = process.env.MODELFORGE_TEST_NVML_DIR;
  assert.ok(nvmlDir, "MODELFORGE_TEST_NVML_DIR (the substitute NVML library) must be set");
  const page = await newPage(browser);
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "gpu-node-1", expiry: "15 min", mode: "nvidia" });
  const token = await wizard.getByTestId("enrollment-token").textContent();
  const nodeId = await wizard.getByTestId("node-id").textContent();
  nodes.push(startNode("gpu-node-1", token, { mode: "nvidia", nvmlDir }));
  await readyViaWizard(page, wizard);
  await wizard.getByRole("button", { name: "Close" }).click();

  await page.getByRole("link", { name: "Nodes" }).click();
  const row = page.locator(`tr[data-node-id="${nodeId}"]`);
  await row.getByTestId("node-state").filter({ hasText: "online" }).waitFor({ timeout: 20_000 });
  // Both GPUs free, on the node and in the fleet's totals.
  await row.getByTestId("node-free").filter({ hasText: "2 of 2 GPUs" }).waitFor({ timeout: 10_000 });
  await page.getByTestId("fleet-free").filter({ hasText: "2 of 2 GPUs" }).waitFor();
  await row.getByRole("button", { name: /Details/ }).click();
  const chart = page.getByRole("img", { name: /GPU 0 .*utilisation \d+%/ });
  await chart.waitFor({ timeout: 20_000 });
  // Live: more samples arrive while the screen is open (refreshed every 5 s).
  const points = async () => (await page.locator("figure.chart polyline.line-util").first().getAttribute("points")).split(" ").length;
  const before = await points();
  await page.waitForTimeout(6500);
  assert.ok((await points()) > before, "the chart gained samples");
  // Each GPU: utilisation (%), memory (GiB), temperature (°C) and power (W), each chart with
  // its y axis in its unit and a time axis.
  for (const index of [0, 1]) {
    for (const metric of [/utilisation .*: latest utilisation \d+%/, /memory .*: latest memory \d+ GiB/, /temperature .*: latest temperature \d+ °C/, /power .*: latest power \d+ W/]) {
      const name = new RegExp(`GPU ${index} .*` + metric.source);
      assert.equal(await page.getByRole("img", { name }).count(), 1, `GPU ${index}: ${metric}`);
    }
  }
  const axis = await page.getByRole("img", { name: /GPU 0 .*utilisation/ }).locator("text").allTextContents();
  assert.ok(axis.includes("0%") && axis.includes("100%"), `y axis ticks: ${axis}`);
  assert.ok(axis.filter((label) => /\d{1,2}:\d{2}:\d{2}/.test(label)).length === 3, `time axis: ${axis}`);
  await screenshot(page, "nodes-gpu");
  await page.context().close();
});
