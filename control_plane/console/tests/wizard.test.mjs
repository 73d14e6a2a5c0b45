// Hardware → Enroll node. The one-time token is revealed once, lives only in the
// open wizard, and is cleared by closing, revoking, checking readiness and expiry.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { chromium } from "playwright-core";
import {
  ADMIN_TOKEN,
  BASE_URL,
  CHROMIUM_ARGS,
  NODE_AGENT_ENTRY,
  admin,
  assertNowhere,
  browserState,
  claim,
  entryText,
  imageToToken,
  launch,
  newPage,
  openWizardToToken,
  screenshot,
  signIn,
  useAdminToken,
} from "./helpers.mjs";

let browser;
before(async () => (browser = await launch()));
after(async () => browser?.close());

const EXPIRIES = [
  ["5 min", 300],
  ["15 min", 900],
  ["1 h", 3600],
  ["24 h", 86400],
];

test("the expiry options are exactly 5 min, 15 min, 1 h and 24 h", async () => {
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("button", { name: "Enroll node" }).click();
  const wizard = page.getByRole("dialog", { name: "Enroll node" });
  const group = wizard.getByRole("group", { name: "Token expiry" });
  const labels = await group.getByRole("radio").evaluateAll((radios) => radios.map((r) => r.labels[0].textContent));
  assert.deepEqual(labels, ["5 min", "15 min", "1 h", "24 h"]);
  const origin = wizard.getByLabel("API origin (locked to this console)");
  assert.equal(await origin.inputValue(), new URL(page.url()).origin);
  assert.equal(await origin.getAttribute("readonly"), "");
  assert.equal(await wizard.getByRole("status", { name: "Production eligible" }).textContent(), "false");
  await screenshot(page, "wizard-node");
  await page.context().close();
});

for (const [label, seconds] of EXPIRIES) {
  test(`expiry ${label}: the token is shown once, then gone from every browser store`, async () => {
    const page = await newPage(browser);
    await signIn(page);
    const wizard = await openWizardToToken(page, { name: `node-${seconds}`, expiry: label });
    const token = await wizard.getByTestId("enrollment-token").textContent();
    assert.match(token, /^mfe_/);
    assert.equal(await page.getByText(token, { exact: true }).count(), 1, "revealed exactly once");
    const shown = (await wizard.getByTestId("countdown").textContent()).replace("Token expires in ", "");
    const left = shown.split(":").map(Number).reduce((total, part) => total * 60 + part, 0);
    assert.ok(seconds - left >= 0 && seconds - left <= 3, `countdown ${shown} for ${seconds}s`);
    const nodeId = await wizard.getByTestId("node-id").textContent();
    const listed = (await admin("GET", "/api/v1/admin/node-enrollments")).body.find((e) => e.node_id === nodeId);
    assert.equal((Date.parse(listed.expires_at) - Date.parse(listed.created_at)) / 1000, seconds);
    assert.equal(listed.production_eligible, false);
    const env = await wizard.getByLabel(/Generated/).inputValue();
    assert.ok(!env.includes(token) && env.includes(`MODELFORGE_AGENT_CONTROL_PLANE_URL=${new URL(page.url()).origin}`));
    assert.ok(!(await wizard.getByLabel(/Start command/).inputValue()).includes(token));
    if (seconds === 900) await screenshot(page, "wizard-token");

    await wizard.getByRole("button", { name: "Close" }).click();
    await wizard.waitFor({ state: "detached" });
    assertNowhere(await browserState(page), token);
    // Reopening the wizard starts over: nothing of the old reveal comes back.
    await page.getByRole("button", { name: "Enroll node" }).click();
    assertNowhere(await browserState(page), token);
    assert.deepEqual(page.problems, []);
    await page.context().close();
  });
}

test("what the node offers, set under Advanced, is written into the .env: jobs at once 3", async () => {
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("button", { name: "Enroll node" }).click();
  const wizard = page.getByRole("dialog", { name: "Enroll node" });
  await wizard.getByLabel("Display name").fill("parallel-node");
  await wizard.getByRole("radio", { name: "CPU only" }).check();
  await wizard.getByText("Advanced: what the node offers").click();
  await wizard.getByLabel("Jobs at once").fill("3");
  await wizard.getByRole("button", { name: "Next: image" }).click();
  await imageToToken(wizard);
  const env = (await wizard.getByLabel(/Generated/).inputValue()).split("\n");
  assert.ok(env.includes("MODELFORGE_AGENT_PARALLEL=3"), env.join("\n"));
  // The fields left empty are left to the agent: no line for them.
  for (const name of ["CPUS", "GPUS", "RAM_MB", "MAX_IDLE_SECONDS"]) {
    assert.ok(!env.some((line) => line.startsWith(`MODELFORGE_AGENT_${name}=`)), name);
  }
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("over plain http:// on a LAN the wizard warns, and writes the opt-in only once confirmed", async () => {
  // The console at a LAN name (lan.test, resolved to this loopback by Chromium's own rules):
  // plain http:// beyond loopback. At 127.0.0.1 (every other test) no warning is shown.
  const lan = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: [...CHROMIUM_ARGS, "--host-resolver-rules=MAP lan.test 127.0.0.1"],
  });
  try {
    const lanUrl = BASE_URL.replace("127.0.0.1", "lan.test");
    const page = await newPage(lan);
    await page.goto(lanUrl + "/");
    await useAdminToken(page, ADMIN_TOKEN);
    await page.getByRole("heading", { name: "Hardware" }).waitFor();
    await page.getByRole("button", { name: "Enroll node" }).click();
    const wizard = page.getByRole("dialog", { name: "Enroll node" });
    const warning = wizard.getByRole("alert", { name: "Plain HTTP" });
    assert.match(await warning.textContent(), /unencrypted/);
    await wizard.getByLabel("Display name").fill("lan-node");
    await wizard.getByRole("radio", { name: "CPU only" }).check();
    // Not confirmed: the step does not move on.
    await wizard.getByRole("button", { name: "Next: image" }).click();
    assert.equal(await wizard.getByLabel("Node-agent entry of the release manifest").count(), 0);
    await screenshot(page, "wizard-plain-http");
    await wizard.getByLabel("This is a trusted LAN: let the node use plain http://").check();
    await wizard.getByRole("button", { name: "Next: image" }).click();
    await imageToToken(wizard);
    const env = (await wizard.getByLabel(/Generated/).inputValue()).split("\n");
    assert.ok(env.includes(`MODELFORGE_AGENT_CONTROL_PLANE_URL=${lanUrl}`), env.join("\n"));
    assert.ok(env.includes("MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true"), env.join("\n"));
    assert.deepEqual(page.problems, []);
  } finally {
    await lan.close();
  }
  // At loopback: no warning, and no opt-in in the .env.
  const page = await newPage(browser);
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "loopback-node", expiry: "5 min" });
  assert.equal(await wizard.getByRole("alert", { name: "Plain HTTP" }).count(), 0);
  const env = await wizard.getByLabel(/Generated/).inputValue();
  assert.ok(!env.includes("ALLOW_INSECURE_HTTP"), env);
  await page.context().close();
});

test("a token copied with the button is emptied from the clipboard when the reveal clears", async () => {
  const page = await newPage(browser);
  await page.context().grantPermissions(["clipboard-read", "clipboard-write"], { origin: BASE_URL });
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "copy-node", expiry: "5 min" });
  const token = await wizard.getByTestId("enrollment-token").textContent();
  const clipboard = () => page.evaluate(() => navigator.clipboard.readText());
  await wizard.getByRole("button", { name: "Copy token" }).click();
  await wizard.getByRole("button", { name: "Copied" }).waitFor();
  assert.equal(await clipboard(), token);
  await wizard.getByRole("button", { name: "Close" }).click();
  await wizard.waitFor({ state: "detached" });
  const deadline = Date.now() + 5000;
  while ((await clipboard()) !== "") {
    assert.ok(Date.now() < deadline, "the clipboard still holds the token after close");
    await page.waitForTimeout(100);
  }
  await page.context().close();
});

test("revoking the unused token clears the reveal and the token can no longer be claimed", async () => {
  const page = await newPage(browser);
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "to-revoke", expiry: "15 min" });
  const token = await wizard.getByTestId("enrollment-token").textContent();
  await wizard.getByRole("button", { name: "Revoke unused token" }).click();
  await wizard.getByTestId("token-hidden").waitFor();
  assert.match(await wizard.getByTestId("token-hidden").textContent(), /revoked/);
  await wizard.locator(".badge.revoked").first().waitFor();
  assertNowhere(await browserState(page), token);
  const attempt = await claim(token);
  assert.equal(attempt.status, 410);
  assert.equal(attempt.body.error.code, "ENROLLMENT_TOKEN_REVOKED");
  await page.context().close();
});

test("reaching expiry (controlled clock) clears the reveal", async () => {
  const page = await newPage(browser, { clock: new Date() });
  await signIn(page);
  const wizard = await openWizardToToken(page, { name: "to-expire", expiry: "5 min" });
  const token = await wizard.getByTestId("enrollment-token").textContent();
  await page.clock.fastForward("04:50");
  assert.match(await wizard.getByTestId("countdown").textContent(), /0:(0\d|1\d)$/);
  assert.equal(await wizard.getByTestId("enrollment-token").count(), 1, "still shown before expiry");
  await page.clock.fastForward("00:15");
  await wizard.getByTestId("token-hidden").waitFor();
  assert.match(await wizard.getByTestId("token-hidden").textContent(), /expired/);
  assertNowhere(await browserState(page), token);
  await page.context().close();
});

test("a pasted entry that differs from the release is rejected, naming the field", async () => {
  const page = await newPage(browser);
  await signIn(page);
  await page.getByRole("button", { name: "Enroll node" }).click();
  const wizard = page.getByRole("dialog", { name: "Enroll node" });
  await wizard.getByLabel("Display name").fill("bad-image");
  await wizard.getByRole("button", { name: "Next: image" }).click();
  const otherLayer = "sha256:" + "e".repeat(64);
  const cases = [
    [{ tag: "modelforge-node-agent:9.9.9" }, "tag expected"],
    [{ rootfs_layers: [...NODE_AGENT_ENTRY.rootfs_layers.slice(0, -1), otherLayer] }, "rootfs_layers["],
    [{ architecture: NODE_AGENT_ENTRY.architecture === "amd64" ? "arm64" : "amd64" }, "architecture expected"],
    [{ labels: { ...NODE_AGENT_ENTRY.labels, "org.opencontainers.image.revision": "forged" } }, "label org.opencontainers.image.revision"],
    [{ labels: { ...NODE_AGENT_ENTRY.labels, "com.example.extra": "1" } }, "label com.example.extra"],
  ];
  for (const [changes, field] of cases) {
    await wizard.getByLabel("Node-agent entry of the release manifest").fill(entryText(changes));
    await wizard.getByRole("button", { name: "Check image" }).click();
    const alert = wizard.getByRole("alert");
    await alert.waitFor();
    const text = await alert.textContent();
    assert.ok(text.includes("MANIFEST_ENTRY_MISMATCH") && text.includes(field), `${field} in: ${text}`);
    if (field === "tag expected") await screenshot(page, "wizard-image-rejected");
  }
  // The build host's image ID is not compared: a different config_digest is accepted.
  await wizard.getByLabel("Node-agent entry of the release manifest").fill(entryText({ config_digest: "sha256:" + "0".repeat(64) }));
  await wizard.getByRole("button", { name: "Check image" }).click();
  await wizard.getByRole("button", { name: "Create enrollment token" }).waitFor();
  const enrollments = (await admin("GET", "/api/v1/admin/node-enrollments")).body;
  assert.ok(!enrollments.some((e) => e.display_name === "bad-image"), "nothing minted while the image was refused");
  await page.context().close();
});

test("the wizard works with the keyboard alone, and every control has a label", async () => {
  const page = await newPage(browser);
  await signIn(page);
  const press = (key, times = 1) => [...Array(times)].reduce((p) => p.then(() => page.keyboard.press(key)), Promise.resolve());
  const focused = () => page.evaluate(() => {
    const el = document.activeElement;
    return { tag: el?.tagName, id: el?.id, text: el?.textContent?.trim(), label: el?.labels?.[0]?.textContent };
  });
  async function tabTo(predicate, limit = 30) {
    for (let i = 0; i < limit; i += 1) {
      if (predicate(await focused())) return;
      await press("Tab");
    }
    assert.fail(`focus never reached the control (last: ${JSON.stringify(await focused())})`);
  }

  await tabTo((f) => f.text === "Enroll node");
  await press("Enter");
  await page.getByRole("dialog", { name: "Enroll node" }).waitFor();
  await tabTo((f) => f.id === "display-name");
  await page.keyboard.type("keyboard-node");
  await tabTo((f) => f.label === "15 min");
  await press("ArrowLeft"); // radios: arrows move the choice
  assert.equal((await focused()).label, "5 min");
  await tabTo((f) => f.label === "NVIDIA GPUs");
  await press("ArrowRight");
  assert.equal((await focused()).label, "CPU only");
  await press("Enter"); // submits step 1
  await page.getByLabel("Node-agent entry of the release manifest").waitFor();
  await tabTo((f) => f.id === "manifest-entry");
  await page.keyboard.insertText(entryText());
  await tabTo((f) => f.text === "Check image");
  await press("Enter");
  await page.getByRole("button", { name: "Create enrollment token" }).waitFor();
  await tabTo((f) => f.text === "Create enrollment token");
  await press("Enter");
  await page.getByTestId("enrollment-token").waitFor();

  const unlabeled = await page.evaluate(() =>
    [...document.querySelectorAll("input, select, textarea, button")]
      .filter((el) => {
        if (el.tagName === "BUTTON") return !(el.textContent.trim() || el.getAttribute("aria-label"));
        return !(el.labels?.length || el.getAttribute("aria-label") || el.getAttribute("aria-labelledby"));
      })
      .map((el) => el.outerHTML.slice(0, 80)),
  );
  assert.deepEqual(unlabeled, []);
  await tabTo((f) => f.text === "Close");
  await press("Enter");
  await page.getByRole("dialog").waitFor({ state: "detached" });
  await page.context().close();
});
