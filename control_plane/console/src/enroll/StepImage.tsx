import { ErrorNote } from "../ErrorNote";
import { StepActions } from "./StepActions";
import type { EnrollWizardState } from "./useEnrollWizard";

// Step 2: the node-agent image, from the local release bundle or a registry, checked against the
// release before any token exists.
export function StepImage({ wizard }: { wizard: EnrollWizardState }) {
  return (
    <form
      onSubmit={(event) => {
        event.preventDefault();
        wizard.checkImage();
      }}
    >
      <fieldset>
        <legend>Image source</legend>
        {(["bundle", "registry"] as const).map((source) => (
          <label key={source} className="choice">
            <input
              type="radio"
              name="image-source"
              checked={wizard.imageSource === source}
              onChange={() => wizard.setImageSource(source)}
            />
            {source === "bundle" ? "Local release bundle" : "Registry image pinned by digest"}
          </label>
        ))}
      </fieldset>
      {wizard.imageSource === "bundle" ? (
        <>
          <label htmlFor="manifest-entry">Node-agent entry of the release manifest</label>
          <textarea
            id="manifest-entry"
            rows={10}
            spellCheck={false}
            required
            value={wizard.manifestEntry}
            onChange={(event) => wizard.setManifestEntry(event.target.value)}
            aria-describedby="manifest-entry-help"
          />
          <p id="manifest-entry-help" className="help">
            After verifying the bundle and <code>docker image load</code> on the node, paste{" "}
            <code>images.modelforge-node-agent</code> from <code>release-manifest.json</code>. The exact tag,
            RootFS layers, architecture and every label must match; the build host's image ID is ignored.
          </p>
        </>
      ) : (
        <>
          <label htmlFor="registry-image">Registry image (name@sha256:digest)</label>
          <input
            id="registry-image"
            required
            spellCheck={false}
            value={wizard.registryImage}
            onChange={(event) => wizard.setRegistryImage(event.target.value)}
          />
        </>
      )}
      <ErrorNote error={wizard.error} id="image-error" />
      <StepActions onBack={() => wizard.goTo("node")} next="Check image" busy={wizard.busy} />
    </form>
  );
}
