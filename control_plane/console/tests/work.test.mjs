// The work screens against a real control plane with a real CPU node (node agent and runtime
// worker as processes): submit a job and watch it finish, cancel a running one, see a queued
// job's waiting reason, deploy a command service and see it healthy, kill its process and see
// the restart counted, run a sweep dry run, and read models, provisioning and the audit log.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import {
  ADMIN_TOKEN,
  BASE_URL,
  WORKDIR,
  admin,
  assertNowhere,
  browserState,
  launch,
  newPage,
  screenshot,
  signIn,
  startNode,
  until,
} from "./helpers.mjs";

const POOL = { pool: "console-work" };
let browser;
let node;
let nodeId;

function pythonJob(source, extra = {}) {
  return {
    entrypoint: { kind: "python", module: "work", function: "main", source: { "work.py": source } },
    labels: POOL,
    ...extra,
  };
}

before(async () => {
  browser = await launch();
  const minted = await admin("POST", "/api/v1/admin/node-enrollments", {
    display_name: "work-node",
    expires_in_seconds: 900,
    labels: POOL,
  });
  assert.equal(minted.status, 201, JSON.stringify(minted.body));
  nodeId = minted.body.node_id;
  node = startNode("work-node", minted.body.token);
  await until("the work node to be online with its inventory", async () => {
    const view = (await admin("GET", `/api/v1/admin/nodes/${nodeId}`)).body;
    return view?.state === "online" && view.inventory ? view : null;
  });
});

after(async () => {
  node?.stop();
  await browser?.close();
});

test("submit a job from the Jobs screen and watch it finish, with its log and result", async () => {
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Jobs", exact: true }).click();
  await page.getByRole("heading", { name: "Jobs" }).waitFor();
  await page.getByRole("button", { name: "Submit a job" }).click();
  const spec = pythonJob("def main(name):\n    print('hello from', name, flush=True)\n    return {'greeting': 'hello ' + name}\n", {
    params: { name: "the console" },
  });
  await page.getByLabel(/Job \(JSON/).fill(JSON.stringify(spec, null, 2));
  await page.getByRole("button", { name: "Submit", exact: true }).click();

  // The job's page: it runs on the node and finishes; the log was followed while it ran.
  await page.getByRole("heading", { name: /^Job / }).waitFor();
  await page.getByTestId("job-state").filter({ hasText: "succeeded" }).waitFor({ timeout: 60_000 });
  await page.getByTestId("job-log").filter({ hasText: "hello from the console" }).waitFor({ timeout: 10_000 });
  assert.match(await page.getByTestId("job-result").textContent(), /"greeting": "hello the console"/);
  assert.match(await page.locator("ul.events").textContent(), /state/);
  assert.match(await page.locator("dl.facts").textContent(), new RegExp(nodeId));
  await screenshot(page, "job-succeeded");

  // Back to the list: the job is there, newest first, and the state filter narrows it.
  await page.getByRole("link", { name: "← Jobs" }).click();
  await page.getByLabel("State").selectOption("succeeded");
  await page.locator("tr[data-job-id]").first().waitFor();
  const states = await page.getByTestId("job-state").allTextContents();
  assert.ok(states.length >= 1 && states.every((state) => state === "succeeded"), states.join());
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("cancel a running job, with a confirmation", async () => {
  const submitted = await admin(
    "POST",
    "/api/v1/jobs",
    pythonJob("import time\n\ndef main():\n    print('working', flush=True)\n    time.sleep(600)\n"),
  );
  assert.equal(submitted.status, 201, JSON.stringify(submitted.body));
  const jobId = submitted.body.job_id;
  const page = await newPage(browser);
  await signIn(page);
  await page.goto(`${BASE_URL}/jobs/${jobId}`);
  await page.getByTestId("job-state").filter({ hasText: "running" }).waitFor({ timeout: 60_000 });
  await page.getByTestId("job-log").filter({ hasText: "working" }).waitFor({ timeout: 20_000 });

  // Cancel in the dialog changes nothing.
  await page.getByRole("button", { name: "Cancel job" }).click();
  await page.getByRole("dialog", { name: /Cancel job/ }).getByRole("button", { name: "Cancel", exact: true }).click();
  assert.equal((await admin("GET", `/api/v1/jobs/${jobId}`)).body.cancel_requested, false);

  await page.getByRole("button", { name: "Cancel job" }).click();
  await page.getByRole("dialog", { name: /Cancel job/ }).getByRole("button", { name: "Cancel job" }).click();
  await page.getByTestId("job-state").filter({ hasText: "cancelled" }).waitFor({ timeout: 30_000 });
  await page.getByTestId("job-error").waitFor();
  await screenshot(page, "job-cancelled");

  // A finished job can be deleted (confirmed): the console goes back to the list.
  await page.getByRole("button", { name: "Delete job" }).click();
  await page.getByRole("dialog", { name: /Delete job/ }).getByRole("button", { name: "Delete job" }).click();
  await page.getByRole("heading", { name: "Jobs" }).waitFor();
  assert.equal((await admin("GET", `/api/v1/jobs/${jobId}`)).status, 404);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("a queued job shows why it waits, in the list and on its page; the keyboard reaches it", async () => {
  const nowhere = await admin("POST", "/api/v1/jobs", { ...pythonJob("def main():\n    return 1\n"), labels: { site: "nowhere" } });
  const hpc = await admin("POST", "/api/v1/jobs", { ...pythonJob("def main():\n    return 1\n"), labels: { site: "hpc" } });
  assert.equal(nowhere.status, 201);
  assert.equal(hpc.status, 201);
  const page = await newPage(browser);
  await signIn(page);
  await page.goto(`${BASE_URL}/jobs`);
  await page.getByLabel("Labels").fill("site=nowhere");
  await page.getByLabel("Labels").press("Enter");
  const row = page.locator(`tr[data-job-id="${nowhere.body.job_id}"]`);
  await row.filter({ hasText: "NO_MATCHING_NODE" }).waitFor({ timeout: 15_000 });
  assert.equal(await page.locator("tr[data-job-id]").count(), 1, "the label filter keeps only site=nowhere");
  await screenshot(page, "jobs");

  // Keyboard only: Tab from the filter to the job's link, Enter opens it.
  await page.getByRole("button", { name: "Filter" }).focus();
  for (let i = 0; i < 10; i += 1) {
    await page.keyboard.press("Tab");
    const focused = await page.evaluate(() => document.activeElement?.textContent ?? "");
    if (focused.includes(nowhere.body.job_id)) break;
  }
  await page.keyboard.press("Enter");
  const reason = page.getByTestId("waiting-reason");
  await reason.waitFor();
  assert.match(await reason.textContent(), /NO_MATCHING_NODE.*site=nowhere.*Next step/s);
  await screenshot(page, "job-waiting");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("deploy a command service from the form, see it healthy, kill it, see the restart counted", async () => {
  const marker = join(WORKDIR, "service-" + randomBytes(4).toString("hex"));
  mkdirSync(marker);
  const secretValue = "console-secret-" + randomBytes(12).toString("hex");
  assert.equal((await admin("PUT", "/api/v1/admin/secrets/CONSOLE_TEST_SECRET", { value: secretValue })).status, 200);

  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Services" }).click();
  await page.getByRole("button", { name: "Deploy service" }).click();
  await page.getByLabel("Name").fill("console-http");
  await page.getByLabel(/Command, one argument per line/).fill(
    ["python3", "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", marker].join("\n"),
  );
  await page.getByLabel("Labels a node must carry").fill("pool=console-work");
  await page.getByLabel("CPUs").fill("0.5");
  await page.getByRole("checkbox", { name: "CONSOLE_TEST_SECRET" }).check();
  await screenshot(page, "service-deploy");
  await page.getByRole("button", { name: "Deploy", exact: true }).click();

  await page.getByRole("heading", { name: "Service console-http" }).waitFor();
  await page.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor({ timeout: 60_000 });
  const url = await page.locator("dl.facts a").first().textContent();
  assert.match(url, /^http:\/\/127\.0\.0\.1:\d+/);
  assert.equal((await fetch(url)).status, 200, "the service answers at its URL");
  assert.equal(await page.getByTestId("service-restarts").textContent(), "0");

  // Kill its process behind the runtime worker's back: the restart is counted and it is healthy again.
  execFileSync("pkill", ["-KILL", "-f", marker]);
  await page.getByTestId("service-restarts").filter({ hasText: /^[1-9]/ }).waitFor({ timeout: 60_000 });
  await page.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor({ timeout: 60_000 });
  await page.locator("ul.events li", { hasText: "exit" }).first().waitFor({ timeout: 10_000 });
  await screenshot(page, "service");
  // The secret's value is never rendered; only its name.
  assert.match(await page.locator("dl.facts").textContent(), /CONSOLE_TEST_SECRET/);
  assertNowhere(await browserState(page), secretValue);

  // Restart from its page, confirmed: a new generation, counted, and healthy again.
  const before = Number(await page.getByTestId("service-restarts").textContent());
  await page.getByRole("button", { name: "Restart" }).click();
  await page.getByRole("dialog", { name: /Restart console-http/ }).getByRole("button", { name: "Restart" }).click();
  await until("the restart to be counted", async () => Number(await page.getByTestId("service-restarts").textContent()) > before);
  await page.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor({ timeout: 60_000 });
  assert.equal((await admin("GET", "/api/v1/admin/audit?action=service.restart")).body.length, 1);

  // The list shows it with its URL and restart count; undeploy from its page, confirmed.
  await page.getByRole("link", { name: "← Services" }).click();
  const row = page.locator("tr[data-service-id]", { hasText: "console-http" });
  await row.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor();
  assert.notEqual(await row.getByTestId("service-restarts").textContent(), "0");
  await screenshot(page, "services");
  await row.getByRole("link", { name: "console-http" }).click();
  await page.getByRole("button", { name: "Undeploy" }).click();
  await page.getByRole("dialog", { name: /Undeploy console-http/ }).getByRole("button", { name: "Undeploy" }).click();
  await page.getByTestId("service-state").filter({ hasText: "stopped" }).waitFor({ timeout: 20_000 });
  await until("the service's process to end", async () => {
    try {
      execFileSync("pgrep", ["-f", marker]);
      return false;
    } catch {
      return true;
    }
  });
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("artifacts and models: who references what, and a sweep dry run that changes nothing", async () => {
  const upload = async (size) => {
    const response = await fetch(BASE_URL + "/api/v1/artifacts", {
      method: "POST",
      headers: { "X-ModelForge-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/octet-stream" },
      body: randomBytes(size),
    });
    assert.equal(response.status, 201);
    return (await response.json()).digest;
  };
  const digest = await upload(2048);
  const orphan = await upload(4096);
  const model = await admin("POST", "/api/v1/models", { name: "console-demo", version: "1", runner: "command", weights: digest });
  assert.equal(model.status, 201, JSON.stringify(model.body));

  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Models" }).click();
  await page.getByRole("cell", { name: "console-demo@1" }).waitFor();
  await screenshot(page, "models");

  await page.getByRole("link", { name: "Artifacts" }).click();
  const row = page.locator(`tr[data-digest="${digest}"]`);
  await row.filter({ hasText: "model console-demo@1" }).waitFor();
  assert.match(await row.textContent(), /2\.0 KiB/);
  // The grace period here is 1 s: the orphan is old enough to go, the model's weights stay.
  await new Promise((resolve) => setTimeout(resolve, 1500));
  await page.getByRole("button", { name: "Sweep dry run" }).click();
  const report = page.getByTestId("sweep-report");
  await report.waitFor();
  assert.match(await report.textContent(), /Sweep dry run.*would delete 1 artifact\(s\), 4\.0 KiB.*Nothing was changed/s);
  assert.equal(await report.getByRole("table").first().locator("tr", { hasText: orphan }).count(), 1);
  assert.match(await report.locator("tr", { hasText: digest }).textContent(), /named by model console-demo@1/);
  await screenshot(page, "artifacts");

  // Sweep now asks first; Cancel sweeps nothing.
  await page.getByRole("button", { name: "Sweep now" }).click();
  await page.getByRole("dialog", { name: /Delete every unreferenced artifact/ }).getByRole("button", { name: "Cancel" }).click();
  assert.match(await report.textContent(), /Sweep dry run/);
  assert.equal((await admin("GET", "/api/v1/admin/audit?action=artifact.sweep")).body.length, 1, "one sweep: the dry run");
  await page.locator(`tr[data-digest="${orphan}"]`).waitFor();
  const stored = async (which) =>
    (await fetch(`${BASE_URL}/api/v1/artifacts/${which}`, { headers: { "X-ModelForge-Admin-Token": ADMIN_TOKEN } })).status;
  assert.equal(await stored(orphan), 200);

  // Confirmed, it deletes what the dry run listed: the orphan goes, the model's weights stay.
  await page.getByRole("button", { name: "Sweep now" }).click();
  await page.getByRole("dialog", { name: /Delete every unreferenced artifact/ }).getByRole("button", { name: "Sweep now" }).click();
  await report.filter({ hasText: /^Sweep at/ }).waitFor();
  assert.match(await report.textContent(), /deleted \d+ artifact\(s\)/);
  assert.equal(await report.getByRole("table").first().locator("tr", { hasText: orphan }).count(), 1);
  await page.locator(`tr[data-digest="${orphan}"]`).waitFor({ state: "detached" });
  assert.equal(await stored(orphan), 404);
  assert.equal(await stored(digest), 200);
  await page.locator(`tr[data-digest="${digest}"]`).waitFor();
  assert.equal((await admin("GET", "/api/v1/admin/audit?action=artifact.sweep")).body.length, 2, "the dry run and the sweep");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("provisioning: the node a Slurm request brought and its credential's expiry, a failed request; audit by filter", async () => {
  // A site=down job: the `down` provisioner's login host refuses, so its request fails with
  // ssh's exit code and stderr (never a secret).
  assert.equal((await admin("POST", "/api/v1/jobs", { ...pythonJob("def main():\n    return 1\n"), labels: { site: "down" } })).status, 201);
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Provisioning" }).click();
  const down = page.getByRole("region", { name: "Provisioner down" });
  await down.locator('tr[data-state="failed"]').first().waitFor({ timeout: 30_000 });
  assert.match(await down.locator('tr[data-state="failed"]').first().textContent(), /255/);

  // The site=hpc job queued above made a request of the real Slurm cluster: its agent attached
  // with a 24 h credential the provisioner issued, and ran the job.
  const hpc = page.getByRole("region", { name: "Provisioner hpc" });
  await hpc.getByRole("cell", { name: "hpc-cpu" }).first().waitFor();
  const attached = hpc.locator('tr[data-state="attached"]');
  await attached.waitFor({ timeout: 180_000 });
  const requestId = await attached.getAttribute("data-request-id");
  const request = (await admin("GET", "/api/v1/admin/provisioners")).body
    .flatMap((provisioner) => provisioner.requests)
    .find((candidate) => candidate.request_id === requestId);
  const [credential] = (await admin("GET", `/api/v1/admin/credentials?node_id=${request.node_id}`)).body;
  assert.equal(credential.issuer, "provisioner");
  const hours = (Date.parse(credential.expires_at) - Date.parse(credential.issued_at)) / 3_600_000;
  assert.ok(Math.abs(hours - 24) < 0.01, `a 24 h credential, not ${hours} h`);
  await attached.getByTestId("request-node").filter({ hasText: "(online)" }).waitFor({ timeout: 30_000 });
  const shown = await page.evaluate((iso) => new Date(iso).toLocaleString(), credential.expires_at);
  assert.equal(await attached.getByTestId("request-expires").textContent(), shown);
  assert.match(await attached.textContent(), new RegExp(request.slurm_job_id));
  await until("the site=hpc job to succeed on the Slurm node", async () => {
    const jobs = (await admin("GET", "/api/v1/jobs?label=site=hpc")).body;
    return jobs.length === 1 && jobs[0].state === "succeeded" && jobs[0].node_id === request.node_id;
  }, 60_000);
  await screenshot(page, "provisioning");

  await page.getByRole("link", { name: "Audit" }).click();
  await page.locator("tr[data-action]").first().waitFor();
  await page.getByLabel("Action").fill("job.cancel");
  await page.getByLabel("Action").press("Enter");
  await until("the audit filter", async () => {
    const actions = await page.locator("tr[data-action]").evaluateAll((rows) => rows.map((row) => row.dataset.action));
    return actions.length === 1 && actions[0] === "job.cancel";
  });
  assert.match(await page.locator("tr[data-action]").textContent(), /console-session/);
  await screenshot(page, "audit");
  assertNowhere(await browserState(page), ADMIN_TOKEN);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("a node's details: runtime worker version and the queued work it could run; errors are shown", async () => {
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("link", { name: "Nodes" }).click();
  await page.locator(`tr[data-node-id="${nodeId}"]`).getByRole("button", { name: /Details/ }).click();
  await page.getByTestId("runtime-worker").filter({ hasText: /Runtime worker: \d+\.\d+/ }).waitFor();
  await page.getByRole("heading", { name: "Queued work it could run" }).waitFor();
  await page.getByRole("img", { name: /Host CPU/ }).waitFor();

  // An unknown job: its code, message and next step, not a blank page.
  await page.goto(`${BASE_URL}/jobs/no-such-job`);
  await page.getByRole("alert").filter({ hasText: "JOB_NOT_FOUND" }).waitFor();
  await page.context().close();
});
