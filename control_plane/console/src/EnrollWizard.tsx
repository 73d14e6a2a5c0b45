import { type FormEvent, type ReactNode, useEffect, useRef, useState } from "react";
import {
  ApiError,
  api,
  asApiError,
  type Enrollment,
  type MintedEnrollment,
  type NodeImage,
  type NodeSetup,
  type Readiness,
} from "./api";
import { ErrorNote } from "./ErrorNote";
import { clock } from "./format";

// Hardware → Enroll node (UI-2..UI-4).
//
// The one-time token exists only in this component's state: it is never written to storage,
// the URL, a log or a parent component. Closing the wizard (unmount), checking readiness,
// revoking the unused token and reaching its expiry all clear it.

export const EXPIRY_OPTIONS = [
  { seconds: 300, label: "5 min" },
  { seconds: 900, label: "15 min" },
  { seconds: 3600, label: "1 h" },
  { seconds: 86400, label: "24 h" },
] as const;

type Step = "node" | "image" | "start" | "readiness";
type Hidden = "readiness" | "revoked" | "expired";

const HIDDEN_REASON: Record<Hidden, string> = {
  readiness: "The token was hidden when you checked readiness. It was shown once and cannot be shown again.",
  revoked: "The unused token was revoked: it can no longer enroll a node.",
  expired: "The token expired: it can no longer enroll a node. Start the wizard again for a new one.",
};

function CopyButton({ text, label, onCopied }: { text: string; label: string; onCopied?: () => void }) {
  const [copied, setCopied] = useState(false);
  return (
    <button
      type="button"
      className="secondary"
      onClick={() => {
        void navigator.clipboard?.writeText(text).then(
          () => {
            setCopied(true);
            onCopied?.();
          },
          () => setCopied(false),
        );
      }}
    >
      <span aria-live="polite">{copied ? "Copied" : label}</span>
    </button>
  );
}

// A generated command: labelled, read-only, selectable, with a copy button.
function CommandBox(props: { id: string; text: string; rows: number; copyLabel: string; children: ReactNode }) {
  return (
    <>
      <label htmlFor={props.id}>{props.children}</label>
      <textarea id={props.id} readOnly rows={props.rows} value={props.text} spellCheck={false} />
      <CopyButton text={props.text} label={props.copyLabel} />
    </>
  );
}

export function EnrollWizard({ onClose }: { onClose: () => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  const origin = window.location.origin;

  const [step, setStep] = useState<Step>("node");
  const [displayName, setDisplayName] = useState("");
  const [expiry, setExpiry] = useState<number>(900);
  const [accelerator, setAccelerator] = useState<"nvidia" | "cpu">("nvidia");
  const [imageSource, setImageSource] = useState<"bundle" | "registry">("bundle");
  const [manifestEntry, setManifestEntry] = useState("");
  const [registryImage, setRegistryImage] = useState("");
  const [image, setImage] = useState<NodeImage | null>(null);

  const [enrollment, setEnrollment] = useState<Enrollment | null>(null);
  const [token, setToken] = useState<string | null>(null);
  const [hidden, setHidden] = useState<Hidden | null>(null);
  const [deadline, setDeadline] = useState<number | null>(null);
  const [now, setNow] = useState(() => Date.now());
  const [setup, setSetup] = useState<NodeSetup | null>(null);
  const [readiness, setReadiness] = useState<Readiness | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  // If the token was copied with the button, the clipboard is emptied when the reveal clears
  // (best effort: the browser may refuse, and clipboard-history tools are out of reach).
  const tokenCopied = useRef(false);
  useEffect(() => {
    if (token === null && tokenCopied.current) {
      tokenCopied.current = false;
      void navigator.clipboard?.writeText("").catch(() => undefined);
    }
  }, [token]);

  useEffect(() => {
    const element = dialog.current;
    if (element && !element.open) element.showModal();
    return () => {
      setToken(null);
      if (tokenCopied.current) void navigator.clipboard?.writeText("").catch(() => undefined);
    };
  }, []);

  // The countdown; at expiry the reveal is cleared.
  useEffect(() => {
    if (deadline === null || enrollment?.state !== "pending") return;
    const tick = () => {
      const current = Date.now();
      setNow(current);
      if (current >= deadline) {
        setToken(null);
        setHidden("expired");
        setEnrollment((row) => (row ? { ...row, state: "expired" } : row));
      }
    };
    tick();
    const timer = window.setInterval(tick, 1000);
    return () => window.clearInterval(timer);
  }, [deadline, enrollment?.state]);

  function hideToken(reason: Hidden) {
    setToken(null);
    setHidden(reason);
  }

  async function run(work: () => Promise<void>) {
    setBusy(true);
    setError(null);
    try {
      await work();
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  function submitNode(event: FormEvent) {
    event.preventDefault();
    setStep("image");
  }

  function submitImage(event: FormEvent) {
    event.preventDefault();
    void run(async () => {
      const checked = await api.post<NodeImage>("/api/v1/admin/node-images/check", imageBody());
      setImage(checked);
      setStep("start");
    });
  }

  function imageBody() {
    return imageSource === "bundle"
      ? { image_source: "bundle", manifest_entry: manifestEntry }
      : { image_source: "registry", registry_image: registryImage.trim() };
  }

  function createEnrollment() {
    void run(async () => {
      const minted = await api.post<MintedEnrollment>("/api/v1/admin/node-enrollments", {
        display_name: displayName.trim(),
        expires_in_seconds: expiry,
        production_eligible: false,
      });
      const { token: oneTime, api_origin: _origin, ...row } = minted;
      const lifetime = Date.parse(row.expires_at) - Date.parse(row.created_at);
      setDeadline(Date.now() + lifetime);
      setEnrollment(row);
      setToken(oneTime);
      setHidden(null);
      await generateSetup(row.enrollment_id);
    });
  }

  async function generateSetup(enrollmentId: string) {
    const generated = await api.post<NodeSetup>(
      `/api/v1/admin/node-enrollments/${enrollmentId}/node-setup`,
      { ...imageBody(), api_origin: origin, accelerator_mode: accelerator },
    );
    setSetup(generated);
  }

  function revoke() {
    if (!enrollment) return;
    void run(async () => {
      const row = await api.post<Enrollment>(
        `/api/v1/admin/node-enrollments/${enrollment.enrollment_id}/revoke`,
      );
      hideToken("revoked"); // only once the server confirms: a failed revoke leaves it usable
      setEnrollment(row);
    });
  }

  function checkReadiness() {
    if (!enrollment) return;
    if (token) hideToken("readiness");
    setStep("readiness");
    void run(async () => {
      const row = await api.get<Enrollment>(`/api/v1/admin/node-enrollments/${enrollment.enrollment_id}`);
      setEnrollment(row);
      if (row.state !== "claimed") {
        setReadiness(null);
        throw new ApiError(
          409,
          "NODE_NOT_ENROLLED_YET",
          `The enrollment is ${row.state}: no node has used its token yet.`,
          row.state === "pending"
            ? "Run the start command on the node, enter the token at its prompt, then check again."
            : "Start the wizard again for a new token.",
        );
      }
      setReadiness(await api.get<Readiness>(`/api/v1/admin/nodes/${row.node_id}/readiness`));
    });
  }

  const remaining = deadline === null ? 0 : deadline - now;
  const steps: { id: Step; label: string }[] = [
    { id: "node", label: "1. Node" },
    { id: "image", label: "2. Image" },
    { id: "start", label: "3. Token and start" },
    { id: "readiness", label: "4. Readiness" },
  ];

  return (
    <dialog
      ref={dialog}
      className="wizard"
      aria-labelledby="wizard-title"
      onCancel={(event) => {
        event.preventDefault();
        onClose();
      }}
    >
      <div className="wizard-head">
        <h2 id="wizard-title">Enroll node</h2>
        <button type="button" className="secondary" onClick={onClose}>
          Close
        </button>
      </div>
      <ol className="steps" aria-label="Steps">
        {steps.map((item) => (
          <li key={item.id} aria-current={item.id === step ? "step" : undefined}>
            {item.label}
          </li>
        ))}
      </ol>

      {step === "node" && (
        <form onSubmit={submitNode}>
          <label htmlFor="display-name">Display name</label>
          <input
            id="display-name"
            required
            maxLength={120}
            value={displayName}
            onChange={(event) => setDisplayName(event.target.value)}
            autoFocus
          />
          <fieldset>
            <legend>Token expiry</legend>
            {EXPIRY_OPTIONS.map((option) => (
              <label key={option.seconds} className="choice">
                <input
                  type="radio"
                  name="expiry"
                  value={option.seconds}
                  checked={expiry === option.seconds}
                  onChange={() => setExpiry(option.seconds)}
                />
                {option.label}
              </label>
            ))}
          </fieldset>
          <fieldset>
            <legend>Accelerator</legend>
            {(["nvidia", "cpu"] as const).map((mode) => (
              <label key={mode} className="choice">
                <input
                  type="radio"
                  name="accelerator"
                  value={mode}
                  checked={accelerator === mode}
                  onChange={() => setAccelerator(mode)}
                />
                {mode === "nvidia" ? "NVIDIA GPUs" : "CPU only"}
              </label>
            ))}
          </fieldset>
          <label htmlFor="api-origin">API origin (locked to this console)</label>
          <input id="api-origin" readOnly value={origin} aria-describedby="api-origin-help" />
          <p id="api-origin-help" className="help">
            The node agent connects out to exactly this origin; the control plane never dials the node.
          </p>
          <p className="facts">
            <span>Production eligible:</span> <output aria-label="Production eligible">false</output>{" "}
            <span className="help">(release-candidate enrollment: production_eligible=false)</span>
          </p>
          <div className="actions">
            <button type="submit">Next: image</button>
          </div>
        </form>
      )}

      {step === "image" && (
        <form onSubmit={submitImage}>
          <fieldset>
            <legend>Image source</legend>
            <label className="choice">
              <input
                type="radio"
                name="image-source"
                checked={imageSource === "bundle"}
                onChange={() => setImageSource("bundle")}
              />
              Local release bundle
            </label>
            <label className="choice">
              <input
                type="radio"
                name="image-source"
                checked={imageSource === "registry"}
                onChange={() => setImageSource("registry")}
              />
              Registry image pinned by digest
            </label>
          </fieldset>
          {imageSource === "bundle" ? (
            <>
              <label htmlFor="manifest-entry">Node-agent entry of the release manifest</label>
              <textarea
                id="manifest-entry"
                rows={10}
                spellCheck={false}
                required
                value={manifestEntry}
                onChange={(event) => setManifestEntry(event.target.value)}
                aria-describedby="manifest-entry-help"
              />
              <p id="manifest-entry-help" className="help">
                After verifying the bundle and <code>docker image load</code> on the node, paste{" "}
                <code>images.modelforge-node-agent</code> from <code>release-manifest.json</code>. The exact
                tag, RootFS layers, architecture and every label must match; the build host's image ID is
                ignored.
              </p>
            </>
          ) : (
            <>
              <label htmlFor="registry-image">Registry image (name@sha256:digest)</label>
              <input
                id="registry-image"
                required
                spellCheck={false}
                value={registryImage}
                onChange={(event) => setRegistryImage(event.target.value)}
              />
            </>
          )}
          <ErrorNote error={error} id="image-error" />
          <div className="actions">
            <button type="button" className="secondary" onClick={() => setStep("node")}>
              Back
            </button>
            <button type="submit" disabled={busy}>
              Check image
            </button>
          </div>
        </form>
      )}

      {step === "start" && image && (
        <div className="start">
          <p>
            Image <code>{image.image}</code>, checked against {image.checked_against}.
          </p>
          {!enrollment && (
            <>
              <p>
                Create the one-time enrollment token for <strong>{displayName}</strong> (expires{" "}
                {EXPIRY_OPTIONS.find((o) => o.seconds === expiry)?.label} after creation).
              </p>
              <ErrorNote error={error} />
              <div className="actions">
                <button type="button" className="secondary" onClick={() => setStep("image")}>
                  Back
                </button>
                <button type="button" onClick={createEnrollment} disabled={busy}>
                  Create enrollment token
                </button>
              </div>
            </>
          )}
          {enrollment && (
            <>
              <section aria-labelledby="token-heading" className="token-box">
                <h3 id="token-heading">One-time enrollment token</h3>
                {token ? (
                  <>
                    <p className="warning">
                      Shown once, only while this wizard is open. Enter it at the start command's hidden
                      prompt on the node.
                    </p>
                    <output className="secret" data-testid="enrollment-token" aria-label="Enrollment token">
                      {token}
                    </output>
                    <CopyButton text={token} label="Copy token" onCopied={() => (tokenCopied.current = true)} />
                  </>
                ) : (
                  <p data-testid="token-hidden">{hidden ? HIDDEN_REASON[hidden] : "Hidden."}</p>
                )}
                {enrollment.state === "pending" && (
                  <p role="timer" aria-live="off" data-testid="countdown">
                    Token expires in {clock(remaining)}
                  </p>
                )}
                <p>
                  Node ID <code data-testid="node-id">{enrollment.node_id}</code> · enrollment{" "}
                  <span className={"badge " + enrollment.state}>{enrollment.state}</span>
                </p>
              </section>
              {setup && (enrollment.state === "pending" || enrollment.state === "claimed") && (
                <>
                  <label htmlFor="env-file">
                    Generated <code>.env</code> (non-secret settings; the start command writes it as{" "}
                    <code>modelforge-node.env</code>)
                  </label>
                  <textarea id="env-file" readOnly rows={8} value={setup.env_file} spellCheck={false} />
                  <CommandBox id="start-command" text={setup.start_command} rows={12} copyLabel="Copy start command">
                    Start command (paste into Bash in the release's <code>compose/</code> folder)
                  </CommandBox>
                </>
              )}
              <ErrorNote error={error} />
              <div className="actions">
                {!setup && enrollment.state === "pending" && (
                  <button
                    type="button"
                    className="secondary"
                    onClick={() => void run(() => generateSetup(enrollment.enrollment_id))}
                    disabled={busy}
                  >
                    Generate the start command again
                  </button>
                )}
                {enrollment.state === "pending" && (
                  <button type="button" className="danger" onClick={revoke} disabled={busy}>
                    Revoke unused token
                  </button>
                )}
                <button type="button" onClick={checkReadiness} disabled={busy}>
                  Check node readiness
                </button>
              </div>
            </>
          )}
        </div>
      )}

      {step === "readiness" && enrollment && (
        <div className="readiness">
          <p>
            Readiness of node <code>{enrollment.node_id}</code> (this enrollment) ·{" "}
            <span className={"badge " + enrollment.state}>{enrollment.state}</span>
          </p>
          {readiness && (
            <>
              <p className={readiness.ready ? "ok" : "warning"} data-testid="readiness-verdict">
                {readiness.ready ? "Ready: every check passes." : "Not ready yet."}
              </p>
              <table className="list">
                <caption>Readiness checks</caption>
                <thead>
                  <tr>
                    <th scope="col">Check</th>
                    <th scope="col">Status</th>
                    <th scope="col">Detail</th>
                    <th scope="col">Next step</th>
                  </tr>
                </thead>
                <tbody>
                  {readiness.checks.map((check) => (
                    <tr key={check.name} data-check={check.name}>
                      <td>{check.name}</td>
                      <td>
                        <span className={"badge " + check.status}>{check.status}</span>
                      </td>
                      <td>{check.detail}</td>
                      <td>{check.next_step}</td>
                    </tr>
                  ))}
                </tbody>
              </table>
            </>
          )}
          <ErrorNote error={error} />
          {enrollment.state === "claimed" && setup && (
            <CommandBox
              id="recreate-command"
              text={setup.recreate_command}
              rows={10}
              copyLabel="Copy recreation command"
            >
              Container recreation command (removes the one-time token from the running container's
              environment; identity and credential are kept)
            </CommandBox>
          )}
          <div className="actions">
            <button type="button" className="secondary" onClick={() => setStep("start")}>
              Back
            </button>
            <button type="button" onClick={checkReadiness} disabled={busy}>
              Check node readiness
            </button>
          </div>
        </div>
      )}
    </dialog>
  );
}
