// GPU health on the node page (issue 28), against the real control plane and a real node agent
// in NVIDIA mode over the substitute NVML library (two GPUs) with its runtime worker: an operator
// quarantines GPU 1 with a reason and sees the badge, the reason and the timeline entry, then
// re-admits it (healthy again at once); a GPU the agent finds lost turns unhealthy, its
// re-admission is refused with the control plane's code, message and next step while the agent
// still sees the fault, and once the GPU is back an active check runs on it and brings it back.
// Faults are injected through the substitute's control file (MODELFORGE_FAKE_NVML_CONTROL) while
// the agent runs, as tests/nvml_substitute/ describes.
import assert from "node:assert/strict";
import { appendFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { WORKDIR, admin, launch, newPage, screenshot, signIn, startNode } from "./helpers.mjs";

const NAME = "gpu-health-node";
const POOL = { pool: "console-gpu-health" };
const REASON = "fans replaced on Tuesday; watch it";
let browser;
let node;
let nodeId;
let control;
let gpus;

async function until(what, check, timeoutMs = 60_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    assert.ok(Date.now() < deadline, `timed out waiting for ${what}` + (node ? `\nnode log:\n${node.log()}` : ""));
    await new Promise((resolve) => setTimeout(resolve, 300));
  }
}

// One command for the substitute NVML, appended in one write as its readers expect.
function inject(line) {
  appendFileSync(control, line + "\n");
}

async function gpuView(index) {
  const answer = await admin("GET", `/api/v1/admin/nodes/${nodeId}/gpus`);
  assert.equal(answer.status, 200, JSON.stringify(answer.body));
  return answer.body.find((gpu) => gpu.index === index);
}

before(async () => {
  const nvmlDir = process.env.MODELFORGE_TEST_NVML_DIR;
  assert.ok(nvmlDir, "MODELFORGE_TEST_NVML_DIR (the substitute NVML library) must be set");
  browser = await launch();
  const minted = await admin("POST", "/api/v1/admin/node-enrollments", {
    display_name: NAME,
    expires_in_seconds: 900,
    labels: POOL,
  });
  assert.equal(minted.status, 201, JSON.stringify(minted.body));
  nodeId = minted.body.node_id;
  control = join(WORKDIR, "gpu-health-nvml-control");
  writeFileSync(control, "");
  node = startNode(NAME, minted.body.token, {
    mode: "nvidia",
    nvmlDir,
    extraEnv: { MODELFORGE_FAKE_NVML_CONTROL: control },
  });
  const view = await until("the GPU node to be online with its two GPUs", async () => {
    const answer = (await admin("GET", `/api/v1/admin/nodes/${nodeId}`)).body;
    return answer?.state === "online" && answer.inventory?.gpus?.length === 2 ? answer : null;
  });
  gpus = view.inventory.gpus;
});

after(async () => {
  node?.stop();
  await browser?.close();
});

// The node's details on the Nodes screen, where its GPUs' health is.
async function openNode(page) {
  await signIn(page);
  await page.getByRole("link", { name: "Nodes" }).click();
  await page.locator(`tr[data-node-id="${nodeId}"]`).getByRole("button", { name: /Details/ }).click();
  const details = page.locator("section.details");
  await details.getByRole("heading", { name: new RegExp(NAME) }).waitFor();
  return details;
}

const gpuRow = (details, index) => details.locator(`tr[data-gpu-index="${index}"]`);
const badge = (details, index, state) => gpuRow(details, index).getByTestId("gpu-state").filter({ hasText: new RegExp(`^${state}$`) });

test("quarantine GPU 1 from the node page with a reason: badge, reason and timeline; re-admit: healthy again", async () => {
  const page = await newPage(browser);
  const details = await openNode(page);
  await badge(details, 0, "healthy").waitFor({ timeout: 15_000 });
  await badge(details, 1, "healthy").waitFor();
  const uuid = gpus.find((gpu) => gpu.index === 1).uuid;
  assert.match(await gpuRow(details, 1).textContent(), new RegExp(uuid));
  // A GPU in service has nothing to re-admit: no such button.
  assert.equal(await gpuRow(details, 1).getByRole("button", { name: /Re-admit/ }).count(), 0);

  await gpuRow(details, 1).getByRole("button", { name: "Quarantine GPU 1" }).click();
  const dialog = page.getByRole("dialog", { name: "Quarantine GPU 1?" });
  // A blank reason: the control plane's refusal in the dialog, which stays open; nothing changes.
  await dialog.getByLabel("Reason").fill("   ");
  await dialog.getByRole("button", { name: "Quarantine" }).click();
  const refusal = dialog.getByRole("alert");
  await refusal.waitFor();
  assert.match(await refusal.textContent(), /INVALID_REQUEST: .*reason.*Next step: /s);
  assert.equal((await gpuView(1)).state, "healthy", "a refused quarantine changes nothing");

  await dialog.getByLabel("Reason").fill(REASON);
  await dialog.getByRole("button", { name: "Quarantine" }).click();
  await dialog.waitFor({ state: "detached" });
  await badge(details, 1, "quarantined").waitFor();
  await page.getByRole("status").filter({ hasText: "GPU 1: Quarantined" }).waitFor();
  assert.match(await gpuRow(details, 1).getByTestId("gpu-reason").textContent(), new RegExp(`Quarantined by an operator: ${REASON}`));
  // GPU 0 is untouched; the states read apart by colour as well as by word.
  await badge(details, 0, "healthy").waitFor();
  const colour = (index) =>
    gpuRow(details, index)
      .getByTestId("gpu-state")
      .evaluate((element) => {
        const style = getComputedStyle(element);
        return style.color + " on " + style.backgroundColor;
      });
  assert.notEqual(await colour(0), await colour(1));
  // The timeline (opened on the GPU acted on), newest first, has the quarantine with its reason.
  const timeline = details.getByTestId("gpu-timeline");
  await timeline.getByRole("heading", { name: /Timeline of GPU 1/ }).waitFor();
  await timeline.locator("li").first().filter({ hasText: "quarantine" }).filter({ hasText: REASON }).waitFor();
  // The control plane holds the same: GPU 1 out of the schedule with the reason, audited.
  const quarantined = await gpuView(1);
  assert.equal(quarantined.state, "quarantined");
  assert.equal(quarantined.quarantine?.reason, REASON);
  const audit = (await admin("GET", "/api/v1/admin/audit?action=gpu.quarantine")).body;
  assert.ok(audit.some((entry) => entry.outcome === "ok" && entry.actor.startsWith("console-session:")), JSON.stringify(audit));
  await screenshot(page, "nodes-gpu-health");

  await gpuRow(details, 1).getByRole("button", { name: "Re-admit GPU 1" }).click();
  await page.getByRole("status").filter({ hasText: "GPU 1: Re-admitted: the GPU is healthy and back in the schedule." }).waitFor();
  await badge(details, 1, "healthy").waitFor();
  await timeline.locator("li").first().filter({ hasText: "readmit" }).waitFor();
  assert.match(await timeline.locator("li").nth(1).textContent(), new RegExp(`quarantine.*${REASON}`));
  assert.equal((await gpuView(1)).state, "healthy");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("a lost GPU turns unhealthy; re-admission refused while the fault stays, then an active check brings it back", async () => {
  const page = await newPage(browser);
  const details = await openNode(page);
  await badge(details, 1, "healthy").waitFor({ timeout: 15_000 });

  inject("lost 1");
  await badge(details, 1, "unhealthy").waitFor({ timeout: 20_000 });
  assert.match(await gpuRow(details, 1).getByTestId("gpu-reason").textContent(), /lost/i);
  await badge(details, 0, "healthy").waitFor();

  // The agent still sees the fault: refused, with the control plane's message and next step.
  await gpuRow(details, 1).getByRole("button", { name: "Re-admit GPU 1" }).click();
  const outcome = details.getByTestId("gpu-outcome");
  await outcome.getByRole("alert").filter({ hasText: "GPU_NOT_CLEAN" }).waitFor();
  assert.match(await outcome.textContent(), /GPU 1: Re-admission refused\..*GPU_NOT_CLEAN: .+Next step: .+/s);
  assert.equal((await gpuView(1)).state, "unhealthy");
  await screenshot(page, "nodes-gpu-unhealthy");

  // The GPU answers again; the rules keep it unhealthy (sticky) until a check passes on it.
  inject("found 1");
  await until("the agent to report GPU 1 clean", async () => (await gpuView(1)).reported === "healthy", 20_000);
  await badge(details, 1, "unhealthy").waitFor();
  await gpuRow(details, 1).getByRole("button", { name: "Re-admit GPU 1" }).click();
  await page.getByRole("status").filter({ hasText: /GPU 1: Active check started \(job .+\)/ }).waitFor();
  const started = await gpuView(1);
  assert.ok(started.check?.job_id, JSON.stringify(started));
  assert.equal(started.state, "unhealthy", "out of the schedule while the check runs");

  await badge(details, 1, "healthy").waitFor({ timeout: 120_000 });
  const timeline = details.getByTestId("gpu-timeline");
  await timeline.locator("li").first().filter({ hasText: "readmit" }).waitFor();
  const job = (await admin("GET", `/api/v1/jobs/${started.check.job_id}`)).body;
  assert.equal(job.state, "succeeded", JSON.stringify(job));
  assert.equal((await gpuView(1)).check, null);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});
