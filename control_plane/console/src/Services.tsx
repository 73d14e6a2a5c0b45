import { type FormEvent, useState } from "react";
import { ApiError, api, asApiError, type ServiceView } from "./api";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { WaitingReason } from "./Jobs";
import { Go, Labels, when } from "./Labels";
import { ListTable } from "./ListTable";
import { navigate } from "./route";
import { ServiceReplicas } from "./ServiceReplicas";
import { GatewayAddress, ServiceTokens } from "./ServiceTokens";
import { ChatPlayground, LLM_RUNNERS, ServiceUsagePanel } from "./ServiceLlm";
import { ServiceTrafficPanel } from "./ServiceTraffic";
import { useEventStream } from "./useEventStream";
import { usePolled } from "./usePolled";

const REFRESH_MS = 3000;

function labelsOf(text: string): Record<string, string> | string {
  const labels: Record<string, string> = {};
  for (const item of text.split(/[,\s]+/).filter(Boolean)) {
    const at = item.indexOf("=");
    if (at < 1) return item;
    labels[item.slice(0, at)] = item.slice(at + 1);
  }
  return labels;
}

function Url({ url }: { url: string | null }) {
  return url ? (
    <a href={url} target="_blank" rel="noreferrer">
      {url}
    </a>
  ) : (
    <>—</>
  );
}

// Services: deployed models and commands, with their state, URL, restarts and node.
export function Services() {
  const services = usePolled(api.services, [], REFRESH_MS);
  const [deploying, setDeploying] = useState(false);
  return (
    <section aria-labelledby="services-heading">
      <div className="title-row">
        <h1 id="services-heading">Services</h1>
        <button type="button" onClick={() => setDeploying(true)} disabled={deploying}>
          Deploy service
        </button>
      </div>
      {deploying && <DeployForm onClose={() => setDeploying(false)} />}
      <ErrorNote error={services.error} />
      <ListTable
        caption={<>Services, newest first (refreshed every {REFRESH_MS / 1000} s)</>}
        columns={["Name", "State", "Replicas", "URL", "Restarts", "Node", "GPUs", "Deployed"]}
        loaded={services.loaded}
        empty="No services yet: use Deploy service."
        rows={services.data}
        row={(service) => (
          <tr key={service.service_id} data-service-id={service.service_id}>
            <td>
              <Go to={`/services/${service.service_id}`}>{service.name}</Go>
            </td>
            <td>
              <span className={"badge " + service.state} data-testid="service-state">
                {service.state}
              </span>
            </td>
            <td data-testid="service-replicas">{replicaCount(service)}</td>
            <td>
              <Url url={service.url} />
            </td>
            <td data-testid="service-restarts">{service.restarts}</td>
            <td>{service.node_id ? <code>{service.node_id}</code> : "—"}</td>
            <td>{service.gpus.map((gpu) => gpu.index).join(", ") || "—"}</td>
            <td>{ago(service.created_at)}</td>
          </tr>
        )}
      />
    </section>
  );
}

// "healthy/desired" (1/1 for a service from before replicas).
function replicaCount(service: ServiceView): string {
  if (service.state === "stopped") return "—";
  const healthy = (service.replicas ?? []).filter((replica) => replica.state === "healthy").length;
  return `${healthy}/${service.desired_replicas ?? 1}`;
}

function DeployForm({ onClose }: { onClose: () => void }) {
  const models = usePolled(api.models, []);
  const secrets = usePolled(api.secrets, []);
  const [kind, setKind] = useState<"command" | "onnx">("command");
  const [name, setName] = useState("");
  const [command, setCommand] = useState("");
  const [source, setSource] = useState<"none" | "weights" | "model">("none");
  const [weights, setWeights] = useState("");
  const [model, setModel] = useState("");
  const [labelText, setLabelText] = useState("");
  const [cpus, setCpus] = useState("1");
  const [gpus, setGpus] = useState("0");
  // Empty: the runner's own (`/v2/health/ready` for ONNX, `/` for a command).
  const [healthPath, setHealthPath] = useState("");
  const [chosen, setChosen] = useState<string[]>([]);
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function deploy(event: FormEvent) {
    event.preventDefault();
    const labels = labelsOf(labelText);
    if (typeof labels === "string") {
      setError(new ApiError(0, "LABEL_INVALID", `“${labels}” is not key=value.`, "Write labels as key=value, comma-separated."));
      return;
    }
    const body: Record<string, unknown> = {
      name,
      labels,
      resources: { cpus: Number(cpus), gpus: Number(gpus) },
      secrets: chosen,
    };
    if (healthPath.trim()) body.health = { path: healthPath.trim() };
    if (kind === "command") body.command = command.split("\n").filter((line) => line.length > 0);
    else body.runner = "onnx";
    if (source === "weights") body.weights = weights.trim();
    if (source === "model") body.model = model;
    setBusy(true);
    try {
      const service = await api.deployService(body);
      navigate(null, `/services/${service.service_id}`);
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  return (
    <form className="details" aria-labelledby="deploy-heading" onSubmit={(event) => void deploy(event)}>
      <h2 id="deploy-heading">Deploy a service</h2>
      <label htmlFor="service-name">Name</label>
      <input id="service-name" required value={name} onChange={(event) => setName(event.target.value)} />
      <fieldset>
        <legend>What runs</legend>
        <label className="choice">
          <input type="radio" name="kind" checked={kind === "command"} onChange={() => setKind("command")} />
          Command
        </label>
        <label className="choice">
          <input type="radio" name="kind" checked={kind === "onnx"} onChange={() => setKind("onnx")} />
          ONNX runner (Open Inference Protocol)
        </label>
        {kind === "command" && (
          <>
            <label htmlFor="service-command">Command, one argument per line</label>
            <textarea
              id="service-command"
              rows={4}
              value={command}
              spellCheck={false}
              aria-describedby="service-command-help"
              onChange={(event) => setCommand(event.target.value)}
            />
            <div className="help" id="service-command-help">
              <code>{"{port}"}</code> becomes the port it must listen on, <code>{"{weights}"}</code> the local path of its
              weights.
            </div>
          </>
        )}
      </fieldset>
      <fieldset>
        <legend>Weights</legend>
        <label className="choice">
          <input type="radio" name="source" checked={source === "none"} onChange={() => setSource("none")} />
          None
        </label>
        <label className="choice">
          <input type="radio" name="source" checked={source === "weights"} onChange={() => setSource("weights")} />
          Artifact digest
        </label>
        <label className="choice">
          <input type="radio" name="source" checked={source === "model"} onChange={() => setSource("model")} />
          Model
        </label>
        {source === "weights" && (
          <>
            <label htmlFor="service-weights">Digest (sha256:…)</label>
            <input id="service-weights" value={weights} onChange={(event) => setWeights(event.target.value)} />
          </>
        )}
        {source === "model" && (
          <>
            <label htmlFor="service-model">Model</label>
            <select id="service-model" value={model} onChange={(event) => setModel(event.target.value)}>
              <option value="">Choose a model…</option>
              {models.data.map((entry) => (
                <option key={entry.model_id} value={entry.ref}>
                  {entry.ref} ({entry.runner})
                </option>
              ))}
            </select>
          </>
        )}
      </fieldset>
      <div className="row">
        <div className="grow">
          <label htmlFor="service-labels">Labels a node must carry</label>
          <input
            id="service-labels"
            value={labelText}
            placeholder="key=value, key=value"
            onChange={(event) => setLabelText(event.target.value)}
          />
        </div>
        <div>
          <label htmlFor="service-cpus">CPUs</label>
          <input id="service-cpus" type="number" min="0" step="0.5" value={cpus} onChange={(event) => setCpus(event.target.value)} />
        </div>
        <div>
          <label htmlFor="service-gpus">GPUs</label>
          <input id="service-gpus" type="number" min="0" step="1" value={gpus} onChange={(event) => setGpus(event.target.value)} />
        </div>
        <div>
          <label htmlFor="service-health">Health path</label>
          <input
            id="service-health"
            value={healthPath}
            placeholder={kind === "onnx" ? "/v2/health/ready" : "/"}
            onChange={(event) => setHealthPath(event.target.value)}
          />
        </div>
      </div>
      <fieldset>
        <legend>Secrets (by name; values are never shown)</legend>
        {secrets.error && <ErrorNote error={secrets.error} />}
        {secrets.loaded && secrets.data.length === 0 && <p className="help">No secrets are set.</p>}
        {secrets.data.map((secret) => (
          <label className="choice" key={secret.name}>
            <input
              type="checkbox"
              checked={chosen.includes(secret.name)}
              onChange={(event) =>
                setChosen(event.target.checked ? [...chosen, secret.name] : chosen.filter((n) => n !== secret.name))
              }
            />
            {secret.name}
          </label>
        ))}
      </fieldset>
      <ErrorNote error={error} />
      <div className="actions">
        <button type="button" className="secondary" onClick={onClose}>
          Close
        </button>
        <button type="submit" disabled={busy}>
          {busy ? "Deploying…" : "Deploy"}
        </button>
      </div>
    </form>
  );
}

function describe(data: unknown): string {
  if (data === null || data === undefined) return "";
  if (typeof data === "string") return data;
  if (typeof data === "object")
    return Object.entries(data as Record<string, unknown>)
      .map(([key, value]) => `${key}=${typeof value === "string" ? value : JSON.stringify(value)}`)
      .join(" ");
  return JSON.stringify(data);
}

// One service: state, node, URL, restarts, last exit, why it waits, events and recent log;
// restart and undeploy, each confirmed.
export function ServicePage({ serviceId }: { serviceId: string }) {
  const polled = usePolled(api.service(serviceId), null as ServiceView | null, REFRESH_MS);
  const events = useEventStream(serviceId, (after, signal) => api.serviceEvents(serviceId, after, signal), REFRESH_MS, 200);
  const [asking, setAsking] = useState<"restart" | "undeploy" | null>(null);
  const [failure, setFailure] = useState<ApiError | null>(null);
  const service = polled.data;
  const deployed = service !== null && service.state !== "stopped";
  const llm = service !== null && service.runner !== null && LLM_RUNNERS.includes(service.runner);

  async function act(what: "restart" | "undeploy") {
    setAsking(null);
    setFailure(null);
    try {
      if (what === "restart") await api.restartService(serviceId);
      else await api.undeployService(serviceId);
      await polled.reload();
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <section aria-labelledby="service-heading">
      <p>
        <Go to="/services">← Services</Go>
      </p>
      <h1 id="service-heading">Service {service ? service.name : <code>{serviceId}</code>}</h1>
      <ErrorNote error={polled.error} />
      {!polled.loaded && <p className="loading-row">Loading…</p>}
      {service && (
        <>
          <dl className="facts">
            <dt>State</dt>
            <dd>
              <span className={"badge " + service.state} data-testid="service-state">
                {service.state}
              </span>
            </dd>
            <dt>URL</dt>
            <dd>
              <Url url={service.url} />
              {service.url && <span className="help"> (one replica's; clients use the gateway address)</span>}
            </dd>
            <dt>gRPC</dt>
            <dd data-testid="service-grpc-url">
              {service.grpc_url ? <code>{service.grpc_url}</code> : "—"}
            </dd>
            <dt>Restarts</dt>
            <dd data-testid="service-restarts">{service.restarts}</dd>
            <dt>Last exit</dt>
            <dd>{service.last_exit ? describe(service.last_exit) : "—"}</dd>
            <dt>Node</dt>
            <dd>{service.node_id ? <code>{service.node_id}</code> : "not placed"}</dd>
            <dt>GPUs</dt>
            <dd>{service.gpus.map((gpu) => `GPU ${gpu.index} (${gpu.uuid})`).join(", ") || "none"}</dd>
            <dt>Runs</dt>
            <dd>
              {service.command ? <code>{service.command.join(" ")}</code> : `runner ${service.runner}`}
              {service.model ? ` · model ${service.model}` : service.weights ? ` · weights ${service.weights}` : ""}
            </dd>
            <dt>Labels</dt>
            <dd>
              <Labels labels={service.labels} />
            </dd>
            <dt>Secrets (names)</dt>
            <dd>{service.secrets.join(", ") || "none"}</dd>
            {service.rollout && (
              <>
                <dt>Rollout</dt>
                <dd data-testid="service-rollout">{describe(service.rollout)}</dd>
              </>
            )}
            <dt>Generation · deployed · stopped</dt>
            <dd>
              {service.generation} · {when(service.created_at)} · {when(service.stopped_at)}
            </dd>
          </dl>
          {service.waiting_reason && <WaitingReason reason={service.waiting_reason} />}
          <ErrorNote error={failure} />
          {deployed && (
            <div className="actions start">
              <button type="button" className="secondary" onClick={() => setAsking("restart")}>
                Restart
              </button>
              <button type="button" className="danger" onClick={() => setAsking("undeploy")}>
                Undeploy
              </button>
            </div>
          )}
          {deployed && <GatewayAddress service={service} />}
          <h2>Replicas</h2>
          <ServiceReplicas replicas={service.replicas ?? []} desired={service.desired_replicas ?? 1} />
          {deployed && <ServiceTrafficPanel serviceId={serviceId} />}
          {llm && deployed && <ChatPlayground model={service.name} />}
          {llm && <ServiceUsagePanel serviceId={serviceId} />}
          <ServiceTokens serviceId={serviceId} deployed={deployed} />
          <h2>Recent log</h2>
          <pre className="log" data-testid="service-log">
            {service.log_tail.length ? service.log_tail.join("\n") : "(no output reported yet)"}
          </pre>
        </>
      )}
      <h2>Events</h2>
      <ErrorNote error={events.error} />
      <ul className="events">
        {events.events.length === 0 && <li>{polled.loaded ? "No events yet." : "Loading…"}</li>}
        {[...events.events].reverse().map((event) => (
          <li key={event.seq}>
            <time dateTime={event.at}>{new Date(event.at).toLocaleTimeString()}</time> <strong>{event.kind}</strong>{" "}
            {event.replica_id && <code className="detail">{event.replica_id} </code>}
            {describe(event.data)}
          </li>
        ))}
      </ul>
      {asking && service && (
        <Confirm
          title={asking === "restart" ? `Restart ${service.name}?` : `Undeploy ${service.name}?`}
          action={asking === "restart" ? "Restart" : "Undeploy"}
          danger={asking === "undeploy"}
          onConfirm={() => void act(asking)}
          onCancel={() => setAsking(null)}
        >
          <p>
            {asking === "restart"
              ? "Its node stops the process group and starts it again (a new generation); requests fail until it is healthy."
              : "Its node stops its process group at its next sync and its resources are freed. This cannot be undone: deploy again to bring it back."}
          </p>
        </Confirm>
      )}
    </section>
  );
}
