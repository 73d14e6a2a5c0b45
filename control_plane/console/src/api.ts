// The console's only door to the control plane. The session is an HttpOnly cookie the browser
// sends by itself; the CSRF token lives in this module's memory (never in storage) and goes with
// every change. The admin token is sent exactly once, to sign in, and is not kept.

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly nextStep: string,
  ) {
    super(message);
  }
}

// Whatever a call threw, as a refusal the console can show (code, message, next step).
export function asApiError(caught: unknown): ApiError {
  return caught instanceof ApiError ? caught : new ApiError(0, "UNEXPECTED", String(caught), "Retry.");
}

let csrfToken: string | null = null;
let onSignedOut: () => void = () => {};

export function whenSignedOut(callback: () => void): void {
  onSignedOut = callback;
}

export interface SessionInfo {
  csrf_token: string;
  expires_at: string;
  // The signed-in user; null for a session of the admin token (break-glass).
  user: string | null;
  role: "admin" | "operator" | "member" | "viewer";
}

// Who the console acts as, and what its role lets it read and change (`area:read`,
// `area:change`), from GET /api/v1/me.
export interface Me {
  actor: string;
  via: "admin-token" | "session" | "key";
  role: SessionInfo["role"];
  user: string | null;
  may: string[];
}

const SESSION = "/api/v1/console/session";
const ENROLLMENTS = "/api/v1/admin/node-enrollments";
const NODES = "/api/v1/admin/nodes";
const NODE_IMAGE_CHECK = "/api/v1/admin/node-images/check";

async function request<T>(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
  const headers: Record<string, string> = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && csrfToken) headers["X-ModelForge-CSRF"] = csrfToken;
  let response: Response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
      cache: "no-store",
      signal,
    });
  } catch (caught) {
    if (signal?.aborted) throw caught;
    throw new ApiError(0, "NETWORK", "The control plane did not answer.", "Check that it is running, then retry.");
  }
  if (response.status === 204) return undefined as T;
  const data: unknown = await response.json().catch(() => null);
  if (!response.ok) {
    const error = (data as { error?: { code?: string; message?: string; next_step?: string } } | null)?.error;
    const failure = new ApiError(
      response.status,
      error?.code ?? "HTTP_" + response.status,
      error?.message ?? `The control plane answered ${response.status}.`,
      error?.next_step ?? "Retry; if it persists, read the control plane log.",
    );
    if (response.status === 401 && path !== SESSION) {
      csrfToken = null;
      onSignedOut();
    }
    throw failure;
  }
  return data as T;
}

const get = <T>(path: string) => request<T>("GET", path);
const post = <T>(path: string, body: unknown = {}) => request<T>("POST", path, body);
const del = <T>(path: string) => request<T>("DELETE", path);
const JOBS = "/api/v1/jobs";
const SERVICES = "/api/v1/services";

// A query string from the parameters that are set (repeated keys as arrays).
function query(params: Record<string, string | number | readonly string[] | null | undefined>): string {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === null || value === undefined || value === "") continue;
    for (const item of Array.isArray(value) ? value : [value]) search.append(key, String(item));
  }
  const text = search.toString();
  return text ? "?" + text : "";
}

// Something the console reads and may poll: its URL, typed with the shape it answers. The URL
// also names it, so usePolled can tell when it is asked for something else.
declare const answers: unique symbol;
export type Resource<T> = string & { readonly [answers]?: T };
const resource = <T>(path: string) => path as Resource<T>;

export function read<T>(what: Resource<T>): Promise<T> {
  return get<T>(what);
}

export type ImageChoice =
  | { image_source: "bundle"; manifest_entry: string }
  | { image_source: "registry"; registry_image: string };

export interface EnrollmentRequest {
  display_name: string;
  expires_in_seconds: number;
  production_eligible: boolean;
}

// What the node offers and its idle exit; each left out is left to the agent.
export type NodeOfferRequest = Partial<
  Record<"parallel" | "cpus" | "gpus" | "ram_mb" | "max_idle_seconds", number>
>;
export type NodeSetupRequest = ImageChoice &
  NodeOfferRequest & { api_origin: string; accelerator_mode: "nvidia" | "cpu"; allow_insecure_http?: boolean };

// Every endpoint the console calls. Path segments are IDs the control plane issued.
export const api = {
  enrollments: resource<Enrollment[]>(ENROLLMENTS),
  nodes: resource<NodeView[]>(NODES),
  nodeTelemetry: (nodeId: string, minutes: number) =>
    resource<TelemetryPoint[]>(`${NODES}/${nodeId}/telemetry?minutes=${minutes}`),
  nodeEvents: (nodeId: string, limit: number) => resource<NodeEvent[]>(`${NODES}/${nodeId}/events?limit=${limit}`),

  checkNodeImage: (body: ImageChoice) => post<NodeImage>(NODE_IMAGE_CHECK, body),
  mintEnrollment: (body: EnrollmentRequest) => post<MintedEnrollment>(ENROLLMENTS, body),
  getEnrollment: (enrollmentId: string) => get<Enrollment>(`${ENROLLMENTS}/${enrollmentId}`),
  nodeSetup: (enrollmentId: string, body: NodeSetupRequest) =>
    post<NodeSetup>(`${ENROLLMENTS}/${enrollmentId}/node-setup`, body),
  revokeEnrollment: (enrollmentId: string) => post<Enrollment>(`${ENROLLMENTS}/${enrollmentId}/revoke`),
  nodeReadiness: (nodeId: string) => get<Readiness>(`${NODES}/${nodeId}/readiness`),
  revokeNodeCredential: (nodeId: string) => post<{ revoked: number }>(`${NODES}/${nodeId}/credential/revoke`),
  nodeQueuedWork: (nodeId: string) => resource<QueuedWork[]>(`${NODES}/${nodeId}/queued-work?limit=20`),
  // Per-GPU health (docs/nodes.md): a GPU's UUID comes from its node, so it is encoded.
  nodeGpus: (nodeId: string) => resource<GpuHealthView[]>(`${NODES}/${nodeId}/gpus`),
  gpuEvents: (nodeId: string, uuid: string, limit: number) =>
    resource<GpuHealthEvent[]>(`${NODES}/${nodeId}/gpus/${encodeURIComponent(uuid)}/events?limit=${limit}`),
  quarantineGpu: (nodeId: string, uuid: string, reason: string) =>
    post<GpuHealthView>(`${NODES}/${nodeId}/gpus/${encodeURIComponent(uuid)}/quarantine`, { reason }),
  // 200: back in the schedule; 202: an active check started (`check` set); 409: refused.
  readmitGpu: (nodeId: string, uuid: string) =>
    post<GpuHealthView>(`${NODES}/${nodeId}/gpus/${encodeURIComponent(uuid)}/readmit`),
  resources: resource<ResourcesView>("/api/v1/admin/resources"),

  jobs: (state: string, labels: readonly string[]) => resource<JobView[]>(JOBS + query({ state, label: labels, limit: 200 })),
  job: (jobId: string) => resource<JobView>(`${JOBS}/${jobId}`),
  // A long poll (`wait` seconds); `signal` ends it when the page is left.
  jobEvents: (jobId: string, after: number, wait: number, signal?: AbortSignal) =>
    request<JobEvent[]>("GET", `${JOBS}/${jobId}/events` + query({ after, wait, limit: 1000 }), undefined, signal),
  submitJob: (body: unknown) => post<JobView>(JOBS, body),
  cancelJob: (jobId: string) => post<JobView>(`${JOBS}/${jobId}/cancel`),
  deleteJob: (jobId: string) => del<void>(`${JOBS}/${jobId}`),

  services: resource<ServiceView[]>(SERVICES + "?limit=200"),
  service: (serviceId: string) => resource<ServiceView>(`${SERVICES}/${serviceId}`),
  serviceEvents: (serviceId: string, after: number, signal?: AbortSignal) =>
    request<ServiceEvent[]>("GET", `${SERVICES}/${serviceId}/events` + query({ after, limit: 1000 }), undefined, signal),
  deployService: (body: unknown) => post<ServiceView>(SERVICES, body),
  restartService: (serviceId: string) => post<ServiceView>(`${SERVICES}/${serviceId}/restart`),
  undeployService: (serviceId: string) => del<ServiceView>(`${SERVICES}/${serviceId}`),
  // The gateway's access tokens (docs/services.md#access-tokens): `token` is in mint's answer only.
  accessTokens: (serviceId: string) => resource<AccessTokenView[]>(`${SERVICES}/${serviceId}/access-tokens`),
  mintAccessToken: (serviceId: string, body: AccessTokenRequest) =>
    post<MintedAccessToken>(`${SERVICES}/${serviceId}/access-tokens`, body),
  revokeAccessToken: (serviceId: string, tokenId: string) =>
    del<AccessTokenView>(`${SERVICES}/${serviceId}/access-tokens/${tokenId}`),
  // The gateway's counters for the service in the answering control-plane process.
  serviceTraffic: (serviceId: string) => resource<ServiceTraffic>(`${SERVICES}/${serviceId}/traffic`),
  serviceUsage: (serviceId: string) => resource<ServiceUsage>(`${SERVICES}/${serviceId}/usage`),
  secrets: resource<SecretView[]>("/api/v1/admin/secrets"),

  models: resource<ModelView[]>("/api/v1/models"),
  artifacts: resource<ArtifactView[]>("/api/v1/artifacts?limit=200"),
  sweep: (dryRun: boolean) => post<SweepReport>("/api/v1/admin/artifacts/sweep", { dry_run: dryRun }),

  // People (docs/access.md): who I am, my personal keys (`key` in mint's answer only), and, for
  // admins, the users.
  me: resource<Me>("/api/v1/me"),
  myKeys: resource<PersonalKeyView[]>("/api/v1/me/keys"),
  mintKey: (body: { name: string; scopes: string[]; expires_in_days: number }) =>
    post<MintedPersonalKey>("/api/v1/me/keys", body),
  revokeKey: (keyId: string) => del<void>(`/api/v1/me/keys/${keyId}`),
  users: resource<UserView[]>("/api/v1/users"),
  createUser: (body: { name: string; role: string; password?: string }) => post<UserView>("/api/v1/users", body),
  updateUser: (name: string, body: { role?: string; disabled?: boolean }) =>
    request<UserView>("PATCH", `/api/v1/users/${encodeURIComponent(name)}`, body),
  deleteUser: (name: string) => del<void>(`/api/v1/users/${encodeURIComponent(name)}`),

  provisioners: resource<Provisioner[]>("/api/v1/admin/provisioners"),
  audit: (filters: { action: string; actor: string; target: string }) =>
    resource<AuditEntry[]>("/api/v1/admin/audit" + query({ ...filters, limit: 200 })),
};

export async function resumeSession(): Promise<Me | null> {
  try {
    const info = await get<SessionInfo>(SESSION);
    csrfToken = info.csrf_token;
    return await get<Me>("/api/v1/me");
  } catch {
    return null;
  }
}

export interface SignInOptions {
  password: boolean;
  // The OpenID provider's display name; null when single sign-on is not configured.
  sso: string | null;
}

export async function signInOptions(): Promise<SignInOptions> {
  return get<SignInOptions>("/api/v1/console/sign-in-options");
}

export interface PersonalKeyView {
  id: string;
  name: string;
  hint: string;
  scopes: string[];
  created_at: string;
  expires_at: string;
}

export interface MintedPersonalKey extends PersonalKeyView {
  key: string;
}

export interface UserView {
  id: string;
  name: string;
  role: SessionInfo["role"];
  disabled: boolean;
  has_password: boolean;
  created_at: string;
  updated_at: string;
  created_by: string;
}

// A user's name and password, or the admin token: exchanged for the session cookie.
export type Credentials = { name: string; password: string } | { admin_token: string };

export async function signIn(credentials: Credentials): Promise<Me> {
  const info = await post<SessionInfo>(SESSION, credentials);
  csrfToken = info.csrf_token;
  return get<Me>("/api/v1/me");
}

// Only a confirmed sign-out forgets the CSRF token: if the server did not end the session, the
// console says so and stays signed in rather than pretend.
export async function signOut(): Promise<void> {
  try {
    await request<void>("DELETE", SESSION);
  } catch (caught) {
    // 401: the session had already ended (expired, or signed out elsewhere).
    if (!(caught instanceof ApiError && caught.status === 401)) throw caught;
  }
  csrfToken = null;
}

// -- the shapes the console reads ---------------------------------------------------------------

export type EnrollmentState = "pending" | "claimed" | "revoked" | "expired";

export interface Enrollment {
  enrollment_id: string;
  node_id: string;
  display_name: string;
  labels: Record<string, string>;
  state: EnrollmentState;
  created_at: string;
  expires_at: string;
  claimed_at: string | null;
  revoked_at: string | null;
  production_eligible: boolean;
}

export interface MintedEnrollment extends Enrollment {
  token: string;
  api_origin: string;
}

export interface NodeImage {
  image: string;
  checked_against: string;
}

export interface NodeSetup extends NodeImage {
  enrollment_id: string;
  node_id: string;
  insecure_http: boolean;
  env_file: string;
  start_command: string;
  recreate_command: string;
}

export interface ReadinessCheck {
  name: string;
  status: "pass" | "fail" | "unknown";
  detail: string;
  next_step: string;
}

export interface Readiness {
  node_id: string;
  ready: boolean;
  checks: ReadinessCheck[];
}

export interface Gpu {
  index: number;
  uuid: string;
  name: string;
  memory_total_mb?: number | null;
}

export interface NodeView {
  node_id: string;
  enrollment_id: string;
  display_name: string;
  hostname: string;
  labels: Record<string, string>;
  state: "online" | "stale" | "offline";
  created_at: string;
  last_heartbeat_at: string | null;
  agent_version: string | null;
  protocol_version: number | null;
  health: { status?: string; message?: string | null } | null;
  needs_upgrade: { code: string; component: string; detail: string } | null;
  duplicate_identity: { other_node_ids: string[]; message: string; next_step: string } | null;
  inventory: {
    gpus?: Gpu[];
    accelerator_mode?: string;
    cpu_count?: number;
    memory_mb?: number;
    runtime_worker?: { version?: string; protocol_version?: number } | null;
    slurm?: { job_id?: string } | null;
  } | null;
  inventory_at: string | null;
  telemetry_at: string | null;
  /** When its active credential expires; null with none active (or one without expiry). */
  credential_expires_at?: string | null;
}

export interface NodeEvent {
  id: number;
  at: string;
  kind: string;
  from_state: string | null;
  to_state: string | null;
  reason: string;
}

export type GpuState = "healthy" | "degraded" | "unhealthy" | "quarantined";

export interface GpuEvidence {
  kind: string;
  at: string;
  detail: string;
  xid?: number;
  value?: number;
}

// GET /api/v1/admin/nodes/{id}/gpus: one per GPU of the node's inventory. `state` is what the
// scheduler reads (quarantined while an operator's quarantine holds, else `rules_state`).
export interface GpuHealthView {
  index: number;
  uuid: string;
  name?: string | null;
  state: GpuState;
  rules_state: Exclude<GpuState, "quarantined">;
  reported: Exclude<GpuState, "quarantined"> | null;
  reason: string;
  evidence: GpuEvidence[];
  since: string | null;
  quarantine: { reason: string; at: string } | null;
  check: { job_id: string; state: string } | null;
}

// GET /api/v1/admin/nodes/{id}/gpus/{uuid}/events: the GPU's timeline, newest first.
export interface GpuHealthEvent {
  id?: number;
  at: string;
  kind: "state" | "quarantine" | "readmit" | "check" | string;
  from_state: string | null;
  to_state: string | null;
  reason: string;
  evidence?: GpuEvidence[] | null;
  actor?: string | null;
}

export interface TelemetryPoint {
  at: string;
  cpu_percent: number | null;
  gpus: {
    index: number;
    uuid: string;
    utilization_percent: number | null;
    memory_used_mb: number | null;
    memory_total_mb: number | null;
    temperature_c?: number | null;
    power_draw_w?: number | null;
    power_limit_w?: number | null;
  }[];
}

export interface QueuedWork {
  kind: "job" | "service";
  id: string;
  name: string;
  created_at: string;
  labels: Record<string, string>;
}

// GET /api/v1/admin/resources: capacity counted by the scheduler's own rules.
export interface Amounts {
  cpus: number;
  memory_mb: number;
  gpus: number;
}

export interface Capacity {
  total: Amounts;
  held: Amounts;
  free: Amounts;
}

export interface HolderRef {
  kind: "job" | "service";
  id: string;
  name: string;
}

export interface NodeResources {
  node_id: string;
  name: string;
  state: "online" | "stale" | "offline";
  schedulable: boolean;
  capacity: Capacity | null;
  gpus: { index: number; uuid: string; model: string | null; held_by: HolderRef | null }[];
  holders: (HolderRef & { cpus: number; memory_mb: number; gpus: number[] })[];
  slots: { in_use: number; total: number | null };
  could_take: { jobs: number; job_ids: string[]; services: number; service_ids: string[] };
}

export interface ResourcesView {
  read_at: string;
  fleet: {
    nodes: number;
    nodes_by_state: Record<"online" | "stale" | "offline", number>;
    needs_upgrade: number;
    capacity: Capacity;
    schedulable: Capacity;
    slots_in_use: number;
    queued_jobs: number;
    pending_services: number;
  };
  nodes: NodeResources[];
  provisioning: { name: string; type: string; outstanding: number; attached: number }[];
}

export interface Reason {
  code: string;
  message: string;
  next_step: string;
}

export interface AssignedGpu {
  index: number;
  uuid: string;
}

export type JobState = "queued" | "running" | "succeeded" | "failed" | "cancelled";

export interface JobView {
  job_id: string;
  state: JobState;
  node_id: string | null;
  entrypoint: Record<string, unknown>;
  params: Record<string, unknown>;
  labels: Record<string, string>;
  resources: Record<string, unknown>;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  cancel_requested: boolean;
  result?: unknown;
  outputs: Record<string, string> | null;
  error: { code: string; message: string; next_step?: string } | null;
  assigned_gpus: AssignedGpu[];
  waiting_reason: Reason | null;
  model: string | null;
  secrets: string[];
}

export interface JobEvent {
  seq: number;
  at: string;
  kind: string;
  data: unknown;
}

export type ServiceState =
  | "pending"
  | "starting"
  | "healthy"
  | "degraded"
  | "idle"
  | "unhealthy"
  | "restarting"
  | "stopped"
  | "failed";

// One running copy of a service (issue 27).
export interface ReplicaView {
  id: string;
  ordinal: number;
  revision: number;
  state: string;
  node_id: string | null;
  url: string | null;
  grpc_url: string | null;
  restarts: number;
  last_exit: Record<string, unknown> | null;
  ready_at: string | null;
  assigned_gpus: AssignedGpu[];
  /** Since when it is in its state, where the control plane says. */
  since?: string | null;
}

export interface ServiceView {
  service_id: string;
  name: string;
  state: ServiceState;
  node_id: string | null;
  url: string | null;
  grpc_url: string | null; // host:port of an onnx service's gRPC front
  restarts: number;
  last_exit: Record<string, unknown> | null;
  gpus: AssignedGpu[];
  command: string[] | null;
  runner: string | null;
  weights: string | null;
  model: string | null;
  labels: Record<string, string>;
  resources: Record<string, unknown>;
  health: Record<string, unknown>;
  secrets: string[];
  generation: number;
  created_at: string;
  stopped_at: string | null;
  waiting_reason: Reason | null;
  log_tail: string[];
  desired_replicas?: number;
  replicas?: ReplicaView[];
  /** An LLM service's other names at the OpenAI API. */
  aliases?: string[];
  /** A rolling update in progress, where one is (its fields as the control plane gives them). */
  rollout?: Record<string, unknown> | null;
}

export interface ServiceEvent {
  seq: number;
  at: string;
  kind: string;
  data: unknown;
  replica_id?: string | null;
}

export interface AccessTokenRequest {
  name: string;
  rate_per_second: number | null;
  burst: number | null;
  tokens_per_minute?: number | null;
}

export interface AccessTokenView {
  id: string;
  service_id: string;
  name: string;
  hint: string;
  rate_per_second: number | null;
  burst: number | null;
  tokens_per_minute: number | null;
  created_at: string;
  created_by: string | null;
  last_used_at: string | null;
  revoked_at: string | null;
}

export interface MintedAccessToken extends AccessTokenView {
  token: string;
}

// GET /api/v1/services/{id}/traffic: cumulative since the answering process started.
export interface ServiceTraffic {
  service_id: string;
  name: string;
  read_at: string;
  requests: Record<string, number>;
  errors: Record<string, number>;
  buckets: { le: number | null; count: number }[];
  count: number;
  seconds_sum: number;
  in_flight: number;
  queue: number;
  // An LLM service's streamed calls (cumulative histograms) and tokens by kind.
  first_token_buckets: { le: number | null; count: number }[];
  inter_token_buckets: { le: number | null; count: number }[];
  tokens: Record<string, number>;
  // Its engines' own requests, as the nodes last read them (null: not an LLM service).
  engine: { processing: number; waiting: number } | null;
}

// An LLM service's tokens over a window (a day before now by default), per API key.
export interface ServiceUsage {
  service_id: string;
  since: string;
  until: string;
  requests: number;
  prompt_tokens: number;
  completion_tokens: number;
  tokens: { token_id: string; name: string; hint: string; requests: number; prompt_tokens: number; completion_tokens: number }[];
}

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

// What a streamed chat call told as it went: each piece of text, then its end (the engine's
// usage when it gave it), or why it failed (the gateway's or the engine's own message).
export type ChatEvent =
  | { kind: "text"; text: string }
  | { kind: "done"; usage: { prompt_tokens: number; completion_tokens: number } | null }
  | { kind: "error"; status: number; code: string; message: string };

// One streamed chat completion through the OpenAI API at this origin (the gateway, as any
// client calls it), with an API key the operator typed: sent only as this call's
// Authorization header, never kept or stored. Server-sent events are read as they arrive.
export async function streamChat(
  key: string,
  model: string,
  messages: ChatMessage[],
  maxTokens: number,
  onEvent: (event: ChatEvent) => void,
  signal?: AbortSignal,
): Promise<void> {
  let response: Response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { Authorization: `Bearer ${key}`, "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify({ model, messages, max_tokens: maxTokens, stream: true, stream_options: { include_usage: true } }),
      credentials: "omit",
      cache: "no-store",
      signal,
    });
  } catch (caught) {
    if (signal?.aborted) return;
    onEvent({ kind: "error", status: 0, code: "NETWORK", message: "The control plane did not answer. Check that it is running, then retry." });
    return;
  }
  if (!response.ok || !response.body) {
    const data: unknown = await response.json().catch(() => null);
    const error = (data as { error?: { code?: string; message?: string } | string } | null)?.error;
    const message = typeof error === "string" ? error : (error?.message ?? `HTTP ${response.status}`);
    const code = typeof error === "object" && error?.code ? error.code : `HTTP_${response.status}`;
    onEvent({ kind: "error", status: response.status, code, message });
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  let usage: { prompt_tokens: number; completion_tokens: number } | null = null;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      let end: number;
      while ((end = pending.indexOf("\n\n")) >= 0) {
        const event = pending.slice(0, end);
        pending = pending.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("");
        if (!data || data === "[DONE]") continue;
        const parsed = JSON.parse(data) as {
          error?: { code?: string; message?: string };
          choices?: { delta?: { content?: string | null } }[];
          usage?: { prompt_tokens: number; completion_tokens: number } | null;
        };
        if (parsed.error) {
          onEvent({ kind: "error", status: 200, code: parsed.error.code ?? "STREAM_ERROR", message: parsed.error.message ?? "The stream failed." });
          return;
        }
        if (parsed.usage) usage = parsed.usage;
        const text = parsed.choices?.[0]?.delta?.content;
        if (text) onEvent({ kind: "text", text });
      }
    }
  } catch (caught) {
    if (signal?.aborted) return;
    onEvent({ kind: "error", status: 0, code: "STREAM_BROKEN", message: "The answer was cut off before its end. Retry." });
    return;
  }
  onEvent({ kind: "done", usage });
}

export interface SecretView {
  name: string;
  labels: Record<string, string>;
}

export interface ModelView {
  model_id: string;
  ref: string;
  runner: string;
  weights: string;
  params: Record<string, unknown>;
  created_at: string;
}

export interface ArtifactView {
  digest: string;
  size_bytes: number;
  created_at: string;
  references: { kind: "model" | "service" | "job"; id: string; name: string; state: string | null }[];
}

export interface SweepReport {
  dry_run: boolean;
  swept_at: string;
  grace_seconds: number;
  deleted: { digest: string; size_bytes: number; created_at: string }[];
  kept: { digest: string; size_bytes: number; reasons: string[] }[];
  removed_files: { path: string; size_bytes: number }[];
  bytes_freed: number;
}

export interface ProvisionRequest {
  request_id: string;
  profile: string;
  state: string;
  slurm_job_id: string | null;
  node_id: string | null;
  age_seconds: number;
  reason: string | null;
  events: { at: string; kind: string; data: unknown }[];
}

export interface Provisioner {
  name: string;
  type: string;
  login: string;
  max_idle_s: number;
  provision_timeout_s: number;
  profiles: { name: string; cpus: number; gpus: number; ram_mb: number; labels: Record<string, string>; outstanding: number }[];
  requests: ProvisionRequest[];
}

export interface AuditEntry {
  id: number;
  at: string;
  actor: string;
  action: string;
  target: string;
  outcome: string;
  detail: Record<string, unknown>;
}
