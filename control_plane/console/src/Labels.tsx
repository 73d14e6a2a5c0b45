import type { MouseEvent, ReactNode } from "react";
import { navigate } from "./route";

export function Labels({ labels }: { labels: Record<string, string> }) {
  const entries = Object.entries(labels);
  if (entries.length === 0) return <span className="help">none</span>;
  return (
    <>
      {entries.map(([key, value]) => (
        <span key={key} className="chip">
          {key}={value}
        </span>
      ))}
    </>
  );
}

// A link to another console screen (a real href, so it opens in a new tab too).
export function Go({ to, children }: { to: string; children: ReactNode }) {
  return (
    <a href={to} onClick={(event: MouseEvent) => navigate(event, to)}>
      {children}
    </a>
  );
}

export function bytes(size: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = size;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}

export function when(iso: string | null): string {
  return iso ? new Date(iso).toLocaleString() : "—";
}
