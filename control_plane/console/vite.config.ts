import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

// The control plane serves dist/ at `/` (index.html) and `/assets/*` (hashed files).
export default defineConfig({
  plugins: [react()],
  base: "/",
  build: {
    outDir: "dist",
    emptyOutDir: true,
    assetsDir: "assets",
    // No inline scripts or styles: the control plane's Content-Security-Policy forbids them.
    assetsInlineLimit: 0,
    sourcemap: false,
  },
});
