import { useEffect, useRef, useState } from "react";
import { api, type ServiceTraffic } from "./api";
import { ErrorNote } from "./ErrorNote";
import { usePolled } from "./usePolled";

const REFRESH_MS = 2000;
// Rates and latencies are over the reads of about this long ago to now.
const WINDOW_MS = 30_000;

type Read = { at: number; traffic: ServiceTraffic };
type Buckets = ServiceTraffic["buckets"];

const sum = (counts: Record<string, number>, keep: (key: string) => boolean = () => true) =>
  Object.entries(counts).reduce((total, [key, value]) => total + (keep(key) ? value : 0), 0);
const serverErrors = (traffic: ServiceTraffic) => sum(traffic.requests, (code) => code.startsWith("5"));

// The latency histogram's counts between two reads (the older one's missing bounds count 0).
function minus(now: Buckets, before: Buckets): Buckets {
  return now.map((bucket) => ({
    le: bucket.le,
    count: bucket.count - (before.find((old) => old.le === bucket.le)?.count ?? 0),
  }));
}

// The q-quantile of a cumulative histogram, interpolated within its bucket as Prometheus'
// histogram_quantile does; `over` when it lies past the last finite bound.
export function quantile(q: number, buckets: Buckets): { seconds: number; over: boolean } | null {
  const total = buckets[buckets.length - 1]?.count ?? 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const bucket of buckets) {
    if (bucket.count >= rank) {
      if (bucket.le === null) return { seconds: lower, over: true };
      const width = bucket.count - below;
      return { seconds: lower + (bucket.le - lower) * (width > 0 ? (rank - below) / width : 1), over: false };
    }
    if (bucket.le !== null) lower = bucket.le;
    below = bucket.count;
  }
  return null;
}

function latency(value: { seconds: number; over: boolean } | null): string {
  if (!value) return "—";
  const { seconds, over } = value;
  const text = seconds < 1 ? `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms` : `${seconds.toFixed(2)} s`;
  return over ? `> ${text}` : text;
}

const perSecond = (count: number, ms: number) => (ms > 0 ? (count / (ms / 1000)).toFixed(count && count < 10 ? 2 : 1) : "—");

// The gateway's numbers for one service: requests and 5xx answers a second and p50/p99
// latency over the last reads (about 30 s), requests in flight and waiting now, and totals since
// the answering control-plane process started (each process counts its own requests).
export function ServiceTrafficPanel({ serviceId }: { serviceId: string }) {
  const polled = usePolled(api.serviceTraffic(serviceId), null as ServiceTraffic | null, REFRESH_MS);
  const reads = useRef<Read[]>([]);
  const [measured, setMeasured] = useState<{ first: Read; last: Read } | null>(null);

  useEffect(() => {
    const traffic = polled.data;
    if (!traffic) return;
    const now = Date.now();
    let kept = reads.current.filter((read) => now - read.at <= WINDOW_MS);
    const previous = kept[kept.length - 1];
    // Counters that went back: another process answered, or it restarted. Start over.
    if (previous && sum(traffic.requests) < sum(previous.traffic.requests)) kept = [];
    kept.push({ at: now, traffic });
    reads.current = kept;
    const first = kept[0];
    setMeasured(first && kept.length > 1 ? { first, last: kept[kept.length - 1] ?? first } : null);
  }, [polled.data]);

  const traffic = polled.data;
  const span = measured ? measured.last.at - measured.first.at : 0;
  const recent = measured ? minus(measured.last.traffic.buckets, measured.first.traffic.buckets) : [];
  const requests = measured ? sum(measured.last.traffic.requests) - sum(measured.first.traffic.requests) : 0;
  const failures = measured ? serverErrors(measured.last.traffic) - serverErrors(measured.first.traffic) : 0;
  const causes = traffic ? Object.entries(traffic.errors).filter(([, count]) => count > 0) : [];
  const llm = traffic !== undefined && traffic !== null && (traffic.engine !== null || Object.keys(traffic.tokens).length > 0);
  const toFirst = measured ? minus(measured.last.traffic.first_token_buckets, measured.first.traffic.first_token_buckets) : [];
  const between = measured ? minus(measured.last.traffic.inter_token_buckets, measured.first.traffic.inter_token_buckets) : [];
  const generated = measured
    ? (measured.last.traffic.tokens.completion ?? 0) - (measured.first.traffic.tokens.completion ?? 0)
    : 0;
  return (
    <section aria-labelledby="traffic-heading">
      <h2 id="traffic-heading">Traffic</h2>
      <ErrorNote error={polled.error} />
      {!polled.loaded && <p className="loading-row">Loading…</p>}
      {traffic && (
        <>
          <dl className="stats" aria-describedby="traffic-help">
            <dt>Requests/s</dt>
            <dd data-testid="traffic-rate">{measured ? perSecond(requests, span) : "—"}</dd>
            <dt>Errors/s (5xx)</dt>
            <dd data-testid="traffic-errors">{measured ? perSecond(failures, span) : "—"}</dd>
            <dt>Latency p50 · p99</dt>
            <dd data-testid="traffic-latency">
              {latency(quantile(0.5, recent))} · {latency(quantile(0.99, recent))}
            </dd>
            <dt>In flight · queued</dt>
            <dd data-testid="traffic-now">
              {traffic.in_flight} · {traffic.queue}
            </dd>
            <dt>Since this process started</dt>
            <dd data-testid="traffic-total">
              {traffic.count} answered
              {Object.keys(traffic.requests).length > 0 &&
                " (" +
                  Object.entries(traffic.requests)
                    .sort(([a], [b]) => a.localeCompare(b))
                    .map(([code, count]) => `${code}: ${count}`)
                    .join(", ") +
                  ")"}
              {traffic.count > 0 &&
                ` · p50 ${latency(quantile(0.5, traffic.buckets))} · p99 ${latency(quantile(0.99, traffic.buckets))}`}
            </dd>
            {llm && (
              <>
                <dt>Time to first token p50 · p99</dt>
                <dd data-testid="llm-first-token">
                  {latency(quantile(0.5, toFirst))} · {latency(quantile(0.99, toFirst))}
                </dd>
                <dt>Between tokens p50</dt>
                <dd data-testid="llm-inter-token">{latency(quantile(0.5, between))}</dd>
                <dt>Tokens/s (generated)</dt>
                <dd data-testid="llm-tokens-rate">{measured ? perSecond(generated, span) : "—"}</dd>
                <dt>Engine: generating · waiting</dt>
                <dd data-testid="llm-engine">
                  {traffic.engine ? `${traffic.engine.processing} · ${traffic.engine.waiting}` : "—"}
                </dd>
              </>
            )}
            <dt>Gateway refusals and retries</dt>
            <dd data-testid="traffic-causes">
              {causes.length ? causes.map(([cause, count]) => `${cause}: ${count}`).join(", ") : "none"}
            </dd>
          </dl>
          <p className="help" id="traffic-help">
            Rates and latencies are over the last {measured ? Math.round(span / 1000) : 0} s of this page's reads
            (every {REFRESH_MS / 1000} s; up to {WINDOW_MS / 1000} s), as counted by the control-plane process that
            answered; latency is from a request's arrival to its response's end.
            {llm &&
              " Token figures are the streamed OpenAI calls' (first token: from arrival; between tokens: each call's mean); the engine's load is what its node last read from it."}
          </p>
        </>
      )}
    </section>
  );
}
