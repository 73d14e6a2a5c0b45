// An LLM service's page (issue 43), against a real control plane and a real CPU node (node agent
// and runtime worker as processes) running llama.cpp's llama-server with SmolLM2's GGUF (both
// made by `make install`): the OpenAI address, a key minted with a tokens-per-minute limit, a
// chat in the playground streamed through the gateway and the tunnel (the text grows while the
// engine generates), a key that opens nothing refused in the gateway's words, the usage per key,
// and the LLM figures in the Traffic panel.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { ADMIN_TOKEN, BASE_URL, admin, assertNowhere, browserState, launch, newPage, screenshot, signIn, startNode, until } from "./helpers.mjs";

const GGUF = join(process.cwd(), "..", "..", "build", "models", "SmolLM2-135M-Instruct.Q4_1.gguf");
const POOL = { pool: "console-llm" };
let browser;
let node;

before(async () => {
  browser = await launch();
  const minted = await admin("POST", "/api/v1/admin/node-enrollments", {
    display_name: "llm-node",
    expires_in_seconds: 900,
    labels: POOL,
  });
  assert.equal(minted.status, 201, JSON.stringify(minted.body));
  const nodeId = minted.body.node_id;
  node = startNode("llm-node", minted.body.token);
  await until("the LLM node to be online", async () => {
    const view = (await admin("GET", `/api/v1/admin/nodes/${nodeId}`)).body;
    return view?.state === "online" && view.inventory ? view : null;
  });
});

after(async () => {
  node?.stop();
  await browser?.close();
});

test("an LLM service: its OpenAI address, a chat streamed in the playground, usage per key, token figures", async () => {
  const upload = await fetch(BASE_URL + "/api/v1/artifacts", {
    method: "POST",
    headers: { "X-ModelForge-Admin-Token": ADMIN_TOKEN },
    body: readFileSync(GGUF),
  });
  const uploaded = await upload.json();
  assert.ok([200, 201].includes(upload.status), JSON.stringify(uploaded));
  // A model names the weights, so they stay referenced after the service is undeployed (the
  // artifacts test's sweep counts only its own orphan).
  const model = await admin("POST", "/api/v1/models", {
    name: "console-smollm2",
    version: "1",
    runner: "llama.cpp",
    weights: uploaded.digest,
  });
  assert.equal(model.status, 201, JSON.stringify(model.body));
  const deployed = await admin("POST", "/api/v1/services", {
    name: "console-llm",
    model: "console-smollm2@1",
    llm: { context_length: 512, slots: 1 },
    aliases: ["console-gpt"],
    labels: POOL,
    resources: { cpus: 1 },
  });
  assert.equal(deployed.status, 201, JSON.stringify(deployed.body));
  const serviceId = deployed.body.service_id;

  const page = await newPage(browser);
  await signIn(page);
  await page.goto(`${BASE_URL}/services/${serviceId}`);
  await page.getByRole("heading", { name: "Service console-llm" }).waitFor();
  await page.getByTestId("service-state").filter({ hasText: "healthy" }).waitFor({ timeout: 120_000 });

  // The address is the OpenAI API's at the control plane's origin; the model is the name.
  assert.equal(await page.getByTestId("gateway-address").textContent(), `${BASE_URL}/v1`);
  const example = await page.getByLabel(/^Example/).inputValue();
  assert.ok(example.includes(`"${BASE_URL}/v1/chat/completions"`) && example.includes('"model": "console-llm"'), example);
  assert.equal(await page.getByTestId("service-aliases").textContent(), " (or console-gpt)");

  // A key with a tokens-per-minute limit, minted in the page and kept by the operator.
  await page.getByRole("button", { name: "Mint token" }).click();
  await page.getByLabel("Token name (who uses it)").fill("playground");
  await page.getByLabel("LLM tokens per minute (optional)").fill("100000");
  await page.getByRole("button", { name: "Mint", exact: true }).click();
  const shown = page.getByTestId("access-token");
  await shown.waitFor();
  const key = (await shown.textContent()).trim();
  await page.getByRole("button", { name: "I have kept it: hide the token" }).click();
  await page.locator("tr[data-token-id]", { hasText: "100000 tokens/min" }).waitFor();

  // A key that opens nothing: the gateway's own words, nothing generated.
  await page.getByLabel("API key").fill("mfs_" + "x".repeat(43));
  await page.getByLabel("Message").fill("Hello?");
  await page.getByRole("button", { name: "Send" }).click();
  await page.getByTestId("playground-error").filter({ hasText: "invalid_api_key" }).waitFor({ timeout: 15_000 });
  assert.equal(await page.getByLabel("Message").inputValue(), "Hello?"); // given back, not sent on
  assert.equal(await page.locator('[data-role="user"]').count(), 0);

  // The kept key: the answer streams in (seen growing before it is whole), then its figures.
  await page.getByLabel("API key").fill(key);
  await page.getByLabel("Message").fill("Write a long story about a dragon.");
  await page.getByRole("button", { name: "Send" }).click();
  const streaming = page.locator('[data-role="streaming"]');
  const lengths = [];
  await until("the answer to grow while it streams", async () => {
    const text = (await streaming.textContent().catch(() => null)) ?? "";
    if (text.length > "console-llm: ".length + 1) lengths.push(text.length);
    return new Set(lengths).size >= 3;
  }, 60_000);
  await page.getByTestId("playground-figures").filter({ hasText: /first token after \d+ ms · \d+ prompt \+ \d+ completion tokens/ }).waitFor({ timeout: 120_000 });
  const answer = page.locator('[data-role="assistant"]');
  assert.equal(await answer.count(), 1);
  assert.equal(await page.locator('[data-role="user"]').count(), 1);
  assert.ok((await answer.textContent()).length > 20);
  assert.equal(await page.getByTestId("playground-error").count(), 0);

  // Usage per key (its name and hint, never the key) and the LLM figures in Traffic.
  const usageRow = page.locator("tr[data-usage-token]", { hasText: "playground" });
  await usageRow.waitFor({ timeout: 15_000 });
  assert.match(await usageRow.textContent(), new RegExp(`playground ${key.slice(0, 10)}…1\\d+\\d+`));
  await page.getByTestId("llm-first-token").filter({ hasText: /\d+(\.\d+)? (ms|s)/ }).waitFor({ timeout: 15_000 });
  await page.getByTestId("llm-engine").filter({ hasText: /^\d+ · \d+$/ }).waitFor({ timeout: 15_000 });
  await page.getByRole("heading", { name: "Chat playground" }).evaluate((heading) => heading.scrollIntoView());
  await screenshot(page, "service-llm");
  // The key was typed into the page: its field holds it while the page is open, and it is
  // nowhere the browser keeps things (storage, cookies, the address).
  const { localStorage, sessionStorage, cookies, url } = await browserState(page);
  assertNowhere({ localStorage, sessionStorage, cookies, url }, key);

  assert.equal((await admin("DELETE", `/api/v1/services/${serviceId}`)).status, 200);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});
