// Batches: a CSV or JSONL file checked row by row on the server, each row saved as a
// case; the results table (filter, sort, export).
import { api, download } from "./api.js";
import { caseLink, loadHistory } from "./cases.js";
import { $, HEADLINES, addCells, addRow, clear, el, fmtP } from "./dom.js";

let batch = null; // {batch_id, file, rows}
let batchFile = null;
let sortKey = "row";
let sortDir = 1;

export function resetBatch() {
  batch = null;
}

function csvHeader(line) {
  const out = [];
  let cell = "", quoted = false;
  for (let i = 0; i < line.length; i++) {
    const ch = line[i];
    if (quoted) {
      if (ch === '"' && line[i + 1] === '"') { cell += '"'; i++; } else if (ch === '"') quoted = false; else cell += ch;
    } else if (ch === '"') quoted = true;
    else if (ch === ",") { out.push(cell); cell = ""; } else cell += ch;
  }
  out.push(cell.replace(/\r$/, ""));
  return out;
}

function columnsOf(name, content) {
  if (/\.csv$/i.test(name)) return csvHeader(content.split("\n", 1)[0]);
  for (const line of content.split("\n").slice(0, 100)) {
    try {
      const obj = JSON.parse(line);
      if (obj && typeof obj === "object" && !Array.isArray(obj)) return Object.keys(obj);
    } catch (err) { /* not JSON: the server reports the row */ }
  }
  return [];
}

export async function loadBatchFile() {
  const file = $("batch-file").files[0];
  const select = $("batch-column");
  clear(select);
  $("batch-error").textContent = "";
  batchFile = null;
  $("batch-run").disabled = true;
  if (!file) return;
  const content = await file.text();
  const columns = columnsOf(file.name, content);
  for (const c of columns) {
    const option = el("option", c);
    option.value = c;
    select.appendChild(option);
  }
  const guess = columns.find((c) => /^(text|body|content|message)$/i.test(c));
  if (guess) select.value = guess;
  batchFile = { name: file.name, content };
  $("batch-run").disabled = !columns.length;
  $("together-run").disabled = !columns.length;
  $("batch-status").textContent = columns.length
    ? `Loaded ${file.name}: choose the column that holds the texts.`
    : "";
  if (!columns.length) $("batch-error").textContent = "No columns found: is it a CSV with a header row, or JSONL objects?";
}

export async function runBatch() {
  if (!batchFile) return;
  const mode = document.querySelector("input[name=mode]:checked").value;
  const button = $("batch-run");
  button.disabled = true;
  $("batch-error").textContent = "";
  $("batch-status").textContent = `Checking ${batchFile.name}…`;
  try {
    batch = await api("POST", "/console/api/cases/batch", {
      filename: batchFile.name, content: batchFile.content, field: $("batch-column").value,
      mode, keep_text: $("keep-text").checked,
    });
    const n = batch.counts;
    $("batch-status").textContent = `Done: ${batch.rows.length} rows; ${n.watermarked} watermarked, ` +
      `${n.inconclusive} inconclusive, ${n.not_watermarked} not watermarked, ${n.error} errors.`;
    $("batch-results").hidden = false;
    renderBatch();
    loadHistory();
  } catch (err) {
    $("batch-status").textContent = "";
    $("batch-error").textContent = err.message;
  } finally {
    button.disabled = false;
  }
}

function batchValue(item, key) {
  const c = item.case;
  const s = (c && c.summary) || {};
  switch (key) {
    case "row": return item.row;
    case "id": return item.id;
    case "verdict": return c ? c.verdict : "error";
    case "p": return c && c.p_value !== null ? c.p_value : Infinity;
    case "tenant": return s.matched_tenant_name || s.matched_tenant || "";
    case "message": return s.message_id === undefined || s.message_id === null ? -1 : s.message_id;
    case "tokens": return s.num_scored_tokens === undefined ? -1 : s.num_scored_tokens;
    default: return "";
  }
}

export function renderBatch() {
  const tbody = $("batch-table").querySelector("tbody");
  clear(tbody);
  if (!batch) return;
  const want = $("batch-filter-verdict").value;
  const needle = $("batch-filter-text").value.trim().toLowerCase();
  const rows = batch.rows.filter((item) => {
    if (want && batchValue(item, "verdict") !== want) return false;
    if (!needle) return true;
    const hay = [item.id, batchValue(item, "tenant"), item.error || "", item.case ? item.case.verdict : ""]
      .join(" ").toLowerCase();
    return hay.includes(needle);
  });
  rows.sort((a, b) => {
    const x = batchValue(a, sortKey), y = batchValue(b, sortKey);
    if (x < y) return -sortDir;
    if (x > y) return sortDir;
    return a.row - b.row;
  });
  for (const item of rows) {
    const c = item.case;
    const tr = el("tr");
    tr.dataset.verdict = c ? c.verdict : "error";
    const s = (c && c.summary) || {};
    const cells = [item.row, item.id, c ? HEADLINES[c.verdict] : "error: " + item.error,
      c && c.p_value !== null ? fmtP(c.p_value) : "",
      s.matched_tenant_name || s.matched_tenant || "",
      s.message_id ?? "", s.num_scored_tokens ?? ""];
    addCells(tr, cells);
    const td = el("td");
    if (c) td.appendChild(caseLink(c.case_id));
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
  $("batch-count").textContent = `Showing ${rows.length} of ${batch.rows.length} rows.`;
  for (const th of $("batch-table").querySelectorAll("th")) {
    const button = th.querySelector("button[data-sort]");
    if (!button) continue;
    if (button.dataset.sort === sortKey) th.setAttribute("aria-sort", sortDir > 0 ? "ascending" : "descending");
    else th.removeAttribute("aria-sort");
  }
}

export function sortBy(event) {
  const button = event.target.closest("button[data-sort]");
  if (!button) return;
  const key = button.dataset.sort;
  sortDir = key === sortKey ? -sortDir : 1;
  sortKey = key;
  renderBatch();
}

export async function exportBatch(fmt) {
  if (!batch) return;
  try {
    await download(`/console/api/cases/export?format=${fmt}&batch_id=${encodeURIComponent(batch.batch_id)}`,
      `batch-${batch.batch_id}.${fmt}`);
  } catch (err) {
    $("batch-error").textContent = err.message;
  }
}


// The CSV file's records (quoted fields may hold commas, quotes and newlines).
function csvRecords(content) {
  const rows = [];
  let row = [], cell = "", quoted = false;
  for (let i = 0; i < content.length; i++) {
    const ch = content[i];
    if (quoted) {
      if (ch === '"' && content[i + 1] === '"') { cell += '"'; i++; } else if (ch === '"') quoted = false; else cell += ch;
    } else if (ch === '"') quoted = true;
    else if (ch === ",") { row.push(cell); cell = ""; } else if (ch === "\n") {
      row.push(cell.replace(/\r$/, "")); rows.push(row); row = []; cell = "";
    } else cell += ch;
  }
  if (cell || row.length) { row.push(cell.replace(/\r$/, "")); rows.push(row); }
  return rows;
}

// The chosen column's non-blank texts, in file order.
export function textsOf(name, content, column) {
  const out = [];
  if (/\.csv$/i.test(name)) {
    const [header, ...rows] = csvRecords(content);
    const at = (header || []).indexOf(column);
    for (const r of rows) if (at >= 0 && r[at] && r[at].trim()) out.push(r[at]);
    return out;
  }
  for (const line of content.split("\n")) {
    try {
      const obj = JSON.parse(line);
      const v = obj && typeof obj === "object" ? obj[column] : null;
      if (typeof v === "string" && v.trim()) out.push(v);
    } catch (err) { /* a bad line is left out of the set */ }
  }
  return out;
}

export async function readTogether() {
  if (!batchFile) return;
  const texts = textsOf(batchFile.name, batchFile.content, $("batch-column").value);
  const field = $("together-group").value.trim();
  const button = $("together-run");
  const box = $("together");
  const facts = $("together-facts");
  $("batch-error").textContent = "";
  if (!texts.length) {
    $("batch-error").textContent = "No texts in that column to read together.";
    return;
  }
  button.disabled = true;
  $("batch-status").textContent = `Reading ${texts.length} texts together…`;
  try {
    const body = field ? { texts, group_by: field } : { texts };
    const a = await api("POST", "/provenance/collection", body);
    clear(facts);
    const shown = a.detail === "verdict"
      ? (a.detail_reason === "full_answers_spent" ? "verdict only: these texts' full answers are spent for today" : "verdict key")
      : `p ${fmtP(a.p_value)}`;
    $("together-verdict").textContent = `Read together: ${HEADLINES[a.verdict]} (${shown})`;
    if (a.detail !== "verdict") {
      addRow(facts, "Texts read together", `${a.num_texts} (${a.num_units} scored tokens after removing repeats)`);
      addRow(facts, "Statistic", a.statistic === "model" ? "model-weighted" : "model-free");
      addRow(facts, "Tenant", a.tenant_name || a.tenant_id || "none named");
      const alone = a.texts.filter((t) => t.verdict === "watermarked").length;
      addRow(facts, "Watermarked alone", `${alone} of ${a.texts.length} texts`);
    }
    const g = a.group;
    if (g) {
      addRow(facts, `Group (${g.field})`, g.may_name ? g.value : "none named");
      addRow(facts, "Group search", `${g.message}; p ${fmtP(g.p_value)} over ${g.values_searched} values`);
    } else if (a.group_value) {
      addRow(facts, "Group", a.group_value);
    }
    box.hidden = false;
    $("batch-status").textContent = "";
  } catch (err) {
    $("batch-status").textContent = "";
    $("batch-error").textContent = err.message;
  } finally {
    button.disabled = false;
  }
}
