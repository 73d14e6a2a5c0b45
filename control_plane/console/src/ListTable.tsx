import type { ReactNode } from "react";

// A list as a table: a caption, one header a column, a row an item (the caller's row() gives each
// its key), and, where `empty` is given, a line saying so when there are no items. With
// `loaded={false}` (nothing answered yet) the one line says "Loading…" instead.
export function ListTable<T>(props: {
  caption: ReactNode;
  columns: readonly ReactNode[];
  rows: readonly T[];
  row: (item: T) => ReactNode;
  empty?: ReactNode;
  loaded?: boolean;
}) {
  const loading = props.loaded === false && props.rows.length === 0;
  return (
    <table className="list">
      <caption>{props.caption}</caption>
      <thead>
        <tr>
          {props.columns.map((column, index) => (
            <th key={index} scope="col">
              {column}
            </th>
          ))}
        </tr>
      </thead>
      <tbody>
        {loading && (
          <tr aria-busy="true">
            <td colSpan={props.columns.length} className="loading-row">
              Loading…
            </td>
          </tr>
        )}
        {!loading && props.empty !== undefined && props.rows.length === 0 && (
          <tr>
            <td colSpan={props.columns.length}>{props.empty}</td>
          </tr>
        )}
        {props.rows.map((item) => props.row(item))}
      </tbody>
    </table>
  );
}
