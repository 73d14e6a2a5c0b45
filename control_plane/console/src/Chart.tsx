// A small line chart (SVG, no library): values over the last minutes, 0..max on the y axis.
export interface Series {
  label: string;
  className: string;
  points: { t: number; v: number | null }[];
  max: number;
  unit: string;
}

const WIDTH = 280;
const HEIGHT = 64;

export function Chart({ title, series, from, to }: { title: string; series: Series[]; from: number; to: number }) {
  const span = Math.max(1, to - from);
  const x = (t: number) => ((t - from) / span) * WIDTH;
  const latest = series
    .map((s) => {
      const last = [...s.points].reverse().find((p) => p.v !== null);
      return `${s.label} ${last?.v == null ? "no data" : Math.round(last.v) + s.unit}`;
    })
    .join(", ");
  return (
    <figure className="chart">
      <svg viewBox={`0 0 ${WIDTH} ${HEIGHT}`} role="img" aria-label={`${title}: latest ${latest}`}>
        <rect x="0" y="0" width={WIDTH} height={HEIGHT} className="chart-bg" />
        {series.map((s) => {
          const coords = s.points
            .filter((p) => p.v !== null)
            .map((p) => `${x(p.t).toFixed(1)},${(HEIGHT - ((p.v as number) / Math.max(s.max, 1)) * HEIGHT).toFixed(1)}`);
          return coords.length > 0 ? <polyline key={s.label} points={coords.join(" ")} className={s.className} /> : null;
        })}
      </svg>
      <figcaption>
        {title} · {latest}
      </figcaption>
    </figure>
  );
}
