// Shared by the console's browser tests. They run under `node --test`, started by
// tests/e2e/test_console_browser.py, which provides a real control plane (Granian, SQLite) and
// these variables. Chromium is Debian's, driven through playwright-core.
import { spawn } from "node:child_process";
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { chromium } from "playwright-core";

function required(name) {
  const value = process.env[name];
  assert.ok(value, `${name} must be set (run these tests through pytest tests/e2e/test_console_browser.py)`);
  return value;
}

export const BASE_URL = required("MODELFORGE_CONSOLE_URL");
export const ADMIN_TOKEN = required("MODELFORGE_TEST_ADMIN_TOKEN");
export const PYTHON = required("MODELFORGE_TEST_PYTHON");
export const WORKDIR = required("MODELFORGE_TEST_WORKDIR");
export const MANIFEST = JSON.parse(readFileSync(required("MODELFORGE_TEST_MANIFEST"), "utf8"));
export const NODE_AGENT_ENTRY = MANIFEST.images["modelforge-node-agent"];
const SCREENSHOTS = process.env.MODELFORGE_CONSOLE_SCREENSHOTS;

export const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--no-first-run",
];

export async function launch() {
  return chromium.launch({ executablePath: "/usr/bin/chromium", headless: true, args: CHROMIUM_ARGS });
}

export async function newPage(browser, { clock } = {}) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (error) => problems.push(String(error)));
  page.on("console", (message) => {
    if (message.type() === "error" && !/status of 4\d\d/.test(message.text())) problems.push(message.text());
  });
  if (clock) await page.clock.install({ time: clock });
  page.problems = problems;
  return page;
}

export async function signIn(page) {
  await page.goto(BASE_URL + "/");
  await useAdminToken(page, ADMIN_TOKEN);
  await page.getByRole("heading", { name: "Hardware" }).waitFor();
}

// The sign-in page's break-glass form (folded under the name and password): open it, fill in
// `token`, send it.
export async function useAdminToken(page, token) {
  await page.getByText("Sign in with the admin token (break-glass)").click();
  await page.getByLabel("Admin token").fill(token);
  await page.getByRole("button", { name: "Sign in with the token" }).click();
}

export async function screenshot(page, name) {
  if (!SCREENSHOTS) return;
  mkdirSync(SCREENSHOTS, { recursive: true });
  await page.screenshot({ path: join(SCREENSHOTS, `${name}.png`) });
}

export function entryText(changes = {}) {
  return JSON.stringify({ ...NODE_AGENT_ENTRY, ...changes }, null, 2);
}

// Steps 1 and 2 of the wizard, with the mouse; returns once the token step is shown.
export async function openWizardToToken(page, { name, expiry, mode = "cpu" }) {
  await page.getByRole("button", { name: "Enroll node" }).click();
  const wizard = page.getByRole("dialog", { name: "Enroll node" });
  await wizard.getByLabel("Display name").fill(name);
  await wizard.getByRole("radio", { name: expiry, exact: true }).check();
  await wizard.getByRole("radio", { name: mode === "cpu" ? "CPU only" : "NVIDIA GPUs" }).check();
  await wizard.getByRole("button", { name: "Next: image" }).click();
  return imageToToken(wizard);
}

// Step 2 from its start (the release's own entry), then the token; returns once it is shown.
export async function imageToToken(wizard) {
  await wizard.getByLabel("Node-agent entry of the release manifest").fill(entryText());
  await wizard.getByRole("button", { name: "Check image" }).click();
  await wizard.getByRole("button", { name: "Create enrollment token" }).click();
  await wizard.getByTestId("enrollment-token").waitFor();
  return wizard;
}

// Everything the browser keeps that a token could hide in.
export async function browserState(page) {
  const inPage = await page.evaluate(() => {
    const values = [...document.querySelectorAll("input, textarea, output")].map((el) => el.value ?? el.textContent);
    const storage = (store) => [...Array(store.length).keys()].map((i) => store.key(i) + "=" + store.getItem(store.key(i)));
    return {
      html: document.documentElement.outerHTML,
      values: values.join("\n"),
      localStorage: storage(window.localStorage).join("\n"),
      sessionStorage: storage(window.sessionStorage).join("\n"),
      url: window.location.href,
      history: String(window.history.length),
    };
  });
  const cookies = await page.context().cookies();
  return { ...inPage, cookies: JSON.stringify(cookies), url: page.url() + "\n" + inPage.url };
}

export function assertNowhere(state, secret) {
  for (const [where, text] of Object.entries(state)) {
    assert.ok(!text.includes(secret), `the token must not be in ${where}`);
  }
}

export async function admin(method, path, body) {
  const response = await fetch(BASE_URL + path, {
    method,
    headers: { "X-ModelForge-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

// What a node would do with the token: try to claim it.
export async function claim(token, extra = {}) {
  const response = await fetch(BASE_URL + "/api/v1/agent/enroll", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      token,
      claim_nonce: "browser-test-nonce-" + Math.random().toString(16).slice(2).padEnd(16, "0"),
      hostname: "claim-probe",
      protocol_version: 1,
      agent_version: "0.1.0",
      ...extra,
    }),
  });
  return { status: response.status, body: await response.json() };
}

// A real node: the runtime worker and the node agent as processes; the token goes in the
// agent's environment (never an argument), as the start command's env file does. `extraEnv`
// goes to both (e.g. the substitute NVML's control file, MODELFORGE_FAKE_NVML_CONTROL).
export function startNode(name, token, { mode = "cpu", nvmlDir, extraEnv = {} } = {}) {
  const root = join(WORKDIR, name);
  mkdirSync(root, { recursive: true });
  const env = { ...process.env };
  for (const key of Object.keys(env)) if (key.startsWith("MODELFORGE_")) delete env[key];
  Object.assign(env, {
    MODELFORGE_AGENT_CONTROL_PLANE_URL: BASE_URL,
    MODELFORGE_AGENT_ACCELERATOR_MODE: mode,
    MODELFORGE_AGENT_STATE_VOLUME: join(root, "state"),
    MODELFORGE_AGENT_WORKER_SOCKET: join(root, "worker.sock"),
    MODELFORGE_AGENT_SOCKET: join(root, "agent.sock"),
    MODELFORGE_ARTIFACT_CACHE: join(root, "cache"),
    MODELFORGE_WORKER_SOCKET: join(root, "worker.sock"),
    MODELFORGE_AGENT_ENROLLMENT_TOKEN: token,
  });
  if (nvmlDir) Object.assign(env, { LD_LIBRARY_PATH: nvmlDir, MODELFORGE_FAKE_NVML_SCENARIO: "healthy" });
  Object.assign(env, extraEnv);
  const options = { env, cwd: process.cwd(), stdio: ["ignore", "pipe", "pipe"] };
  const worker = spawn(PYTHON, ["-m", "runtime_worker"], options);
  const agent = spawn(PYTHON, ["-m", "node_agent"], options);
  let log = "";
  for (const child of [worker, agent]) {
    child.stdout.on("data", (chunk) => (log += chunk));
    child.stderr.on("data", (chunk) => (log += chunk));
  }
  const exited = new Promise((resolve) => agent.on("exit", (code) => resolve(code)));
  return {
    log: () => log,
    exited,
    stop() {
      for (const child of [agent, worker]) if (child.exitCode === null) child.kill("SIGTERM");
    },
  };
}

// The first truthy value `check` gives, asked every 0.3 s; fails naming `what` after `timeoutMs`.
export async function until(what, check, timeoutMs = 60_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    assert.ok(Date.now() < deadline, `timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 300));
  }
}
