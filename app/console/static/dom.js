// Page helpers shared by the console's modules: every text reaches the page through
// textContent, never parsed as HTML.

export const $ = (id) => document.getElementById(id);

export const HEADLINES = { watermarked: "Watermarked", not_watermarked: "No watermark found", inconclusive: "Inconclusive" };

export function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

export function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

export function fmtP(p) {
  if (p === null || p === undefined) return "n/a";
  if (p === 0) return "< 1e-300";
  if (p < 1e-3) return p.toExponential(1);
  return p.toPrecision(2);
}

export function fmtTime(iso) {
  const d = new Date(iso);
  if (isNaN(d.getTime())) return String(iso);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
    `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())} UTC`;
}

// One island of worldcup_core.islands, as text: "start–end (mean z …)".
export function fmtIsland(island) {
  return `${island.start}–${island.end} (mean z ${island.mean_z.toFixed(2)})`;
}

export function addRow(tbody, key, value, mono) {
  const tr = el("tr");
  const th = el("th", key);
  th.scope = "row";
  tr.appendChild(th);
  tr.appendChild(el("td", value, mono ? "mono" : ""));
  tbody.appendChild(tr);
}

// A registry entry's metadata, one row a key, exactly as stored.
export function addMetadataRows(tbody, metadata) {
  for (const [key, value] of Object.entries(metadata || {})) {
    addRow(tbody, "metadata: " + key, typeof value === "string" ? value : JSON.stringify(value), true);
  }
}

// A table's cells in order, each through textContent.
export function addCells(tr, cells) {
  for (const cell of cells) tr.appendChild(el("td", cell));
  return tr;
}
