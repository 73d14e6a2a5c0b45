// A small line chart (SVG, no library) with its axes: values over time, 0..max on the y axis in
// the chart's unit (ticks at 0, half and max), clock times on the x axis (start, middle, end).
export interface Series {
  label: string;
  className: string;
  points: { t: number; v: number | null }[];
}

const WIDTH = 320;
const HEIGHT = 120;
const LEFT = 44;
const RIGHT = 8;
const TOP = 8;
const BOTTOM = 18;
const PLOT_W = WIDTH - LEFT - RIGHT;
const PLOT_H = HEIGHT - TOP - BOTTOM;

function tick(value: number): string {
  if (value >= 100 || Number.isInteger(value)) return String(Math.round(value));
  return value.toFixed(1);
}

function time(t: number): string {
  return new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function Chart(props: {
  title: string;
  unit: string;
  max: number;
  series: Series[];
  from: number;
  to: number;
}) {
  const { title, unit, series, from, to } = props;
  const max = Math.max(props.max, 1e-9);
  const span = Math.max(1, to - from);
  const x = (t: number) => LEFT + ((t - from) / span) * PLOT_W;
  const y = (v: number) => TOP + PLOT_H - (Math.min(v, max) / max) * PLOT_H;
  const latest = series
    .map((s) => {
      const last = [...s.points].reverse().find((p) => p.v !== null);
      return `${s.label} ${last?.v == null ? "no data" : Math.round(last.v) + unit}`;
    })
    .join(", ");
  const yTicks = [0, max / 2, max];
  const xTicks = [from, from + span / 2, to];
  return (
    <figure className="chart">
      <svg viewBox={`0 0 ${WIDTH} ${HEIGHT}`} role="img" aria-label={`${title}: latest ${latest}`}>
        <rect x={LEFT} y={TOP} width={PLOT_W} height={PLOT_H} className="chart-bg" />
        {yTicks.map((value) => (
          <g key={"y" + value} className="axis">
            <line x1={LEFT - 3} x2={LEFT + PLOT_W} y1={y(value)} y2={y(value)} className="grid" />
            <text x={LEFT - 5} y={y(value) + 3} textAnchor="end">
              {tick(value)}
              {unit.trim() === "%" ? "%" : ""}
            </text>
          </g>
        ))}
        <text x={4} y={TOP + 8} className="axis unit">
          {unit.trim() === "%" ? "" : unit.trim()}
        </text>
        {xTicks.map((t, index) => (
          <text
            key={"x" + index}
            x={x(t)}
            y={HEIGHT - 4}
            textAnchor={index === 0 ? "start" : index === 2 ? "end" : "middle"}
            className="axis"
          >
            {time(t)}
          </text>
        ))}
        {series.map((s) => {
          const coords = s.points
            .filter((p) => p.v !== null && p.t >= from)
            .map((p) => `${x(p.t).toFixed(1)},${y(p.v as number).toFixed(1)}`);
          return coords.length > 0 ? <polyline key={s.label} points={coords.join(" ")} className={s.className} /> : null;
        })}
      </svg>
      <figcaption>
        {title} · {latest}
      </figcaption>
    </figure>
  );
}
