import { useEffect, useRef, useState } from "react";
import {
  ApiError,
  api,
  asApiError,
  type Enrollment,
  type ImageChoice,
  type NodeImage,
  type NodeOfferRequest,
  type NodeSetup,
  type Readiness,
} from "../api";

// The Enroll node wizard's state and calls; the step components only render it.
//
// The one-time token exists only in this hook's state: it is never written to storage, the URL,
// a log or a parent component. Closing the wizard (unmount), checking readiness, revoking the
// unused token and reaching its expiry all clear it.

export const EXPIRY_OPTIONS = [
  { seconds: 300, label: "5 min" },
  { seconds: 900, label: "15 min" },
  { seconds: 3600, label: "1 h" },
  { seconds: 86400, label: "24 h" },
] as const;

// What the node offers and its idle exit (the agent's MODELFORGE_AGENT_* variables), within the
// bounds the control plane checks (docs/nodes.md).
export const OFFER_FIELDS = [
  { name: "parallel", label: "Jobs at once", min: 1, max: 256, placeholder: "1" },
  { name: "cpus", label: "CPUs", min: 1, max: 100000, placeholder: "detected" },
  { name: "gpus", label: "GPUs (0: none)", min: 0, max: 64, placeholder: "detected" },
  { name: "ram_mb", label: "Memory (MB)", min: 1, max: 2147483647, placeholder: "detected" },
  { name: "max_idle_seconds", label: "Idle exit (s, 0: never)", min: 0, max: 31536000, placeholder: "never" },
] as const;
export type OfferField = (typeof OFFER_FIELDS)[number]["name"];
export type Offer = Record<OfferField, string>;
const NO_OFFER: Offer = { parallel: "", cpus: "", gpus: "", ram_mb: "", max_idle_seconds: "" };

export type Step = "node" | "image" | "start" | "readiness";
export type Accelerator = "nvidia" | "cpu";
export type ImageSource = "bundle" | "registry";
export type Hidden = "readiness" | "revoked" | "expired";

export type EnrollWizardState = ReturnType<typeof useEnrollWizard>;

// Empties the clipboard (best effort: the browser may refuse, and clipboard-history tools are
// out of reach).
function clearClipboard() {
  void navigator.clipboard?.writeText("").catch(() => undefined);
}

// Plain http:// to anything but this machine's loopback: the node's token, its credential and
// every call would cross the network unencrypted. The control plane writes the agent's opt-in
// (MODELFORGE_AGENT_ALLOW_INSECURE_HTTP) only when the operator confirms a trusted LAN.
export function plainHttpBeyondLoopback(location: Location): boolean {
  const host = location.hostname.replace(/^\[|\]$/g, "");
  const loopback = host === "localhost" || host === "::1" || /^127\./.test(host);
  return location.protocol === "http:" && !loopback;
}

export function useEnrollWizard() {
  const origin = window.location.origin;
  const insecure = plainHttpBeyondLoopback(window.location);
  const [trustedLan, setTrustedLan] = useState(false);

  const [step, setStep] = useState<Step>("node");
  const [displayName, setDisplayName] = useState("");
  const [expiry, setExpiry] = useState<number>(900);
  const [accelerator, setAccelerator] = useState<Accelerator>("nvidia");
  const [offer, setOffer] = useState<Offer>(NO_OFFER);
  const [imageSource, setImageSource] = useState<ImageSource>("bundle");
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

  // If the token was copied with the button, the clipboard is emptied when the reveal clears.
  const tokenCopied = useRef(false);
  useEffect(() => {
    if (token === null && tokenCopied.current) {
      tokenCopied.current = false;
      clearClipboard();
    }
  }, [token]);

  // Closing the wizard clears the reveal.
  useEffect(
    () => () => {
      setToken(null);
      if (tokenCopied.current) clearClipboard();
    },
    [],
  );

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

  function imageChoice(): ImageChoice {
    return imageSource === "bundle"
      ? { image_source: "bundle", manifest_entry: manifestEntry }
      : { image_source: "registry", registry_image: registryImage.trim() };
  }

  function checkImage() {
    void run(async () => {
      setImage(await api.checkNodeImage(imageChoice()));
      setStep("start");
    });
  }

  function createEnrollment() {
    void run(async () => {
      const minted = await api.mintEnrollment({
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

  // Only the fields given; the control plane checks each (a bad one is named in its 422).
  function offered(): NodeOfferRequest {
    const given = OFFER_FIELDS.filter((field) => offer[field.name].trim() !== "");
    return Object.fromEntries(given.map((field) => [field.name, Number(offer[field.name])]));
  }

  async function generateSetup(enrollmentId: string) {
    setSetup(
      await api.nodeSetup(enrollmentId, {
        ...imageChoice(),
        ...offered(),
        api_origin: origin,
        accelerator_mode: accelerator,
        ...(insecure ? { allow_insecure_http: trustedLan } : {}),
      }),
    );
  }

  function regenerateSetup() {
    if (!enrollment) return;
    void run(() => generateSetup(enrollment.enrollment_id));
  }

  function revoke() {
    if (!enrollment) return;
    void run(async () => {
      const row = await api.revokeEnrollment(enrollment.enrollment_id);
      hideToken("revoked"); // only once the server confirms: a failed revoke leaves it usable
      setEnrollment(row);
    });
  }

  function checkReadiness() {
    if (!enrollment) return;
    if (token) hideToken("readiness");
    setStep("readiness");
    void run(async () => {
      const row = await api.getEnrollment(enrollment.enrollment_id);
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
      setReadiness(await api.nodeReadiness(row.node_id));
    });
  }

  return {
    origin,
    insecure,
    trustedLan,
    setTrustedLan,
    step,
    goTo: setStep,
    displayName,
    setDisplayName,
    expiry,
    setExpiry,
    accelerator,
    setAccelerator,
    offer,
    setOfferField: (name: OfferField, value: string) => setOffer((current) => ({ ...current, [name]: value })),
    imageSource,
    setImageSource,
    manifestEntry,
    setManifestEntry,
    registryImage,
    setRegistryImage,
    image,
    enrollment,
    token,
    hidden,
    remaining: deadline === null ? 0 : deadline - now,
    setup,
    readiness,
    error,
    busy,
    tokenCopied: () => {
      tokenCopied.current = true;
    },
    checkImage,
    createEnrollment,
    regenerateSetup,
    revoke,
    checkReadiness,
  };
}
