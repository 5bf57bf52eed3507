// Saved cases: the case report (export, print link, delete), opening a case by its
// link, and the history of recent cases.
import { api, download } from "./api.js";
import { $, HEADLINES, addCells, addMetadataRows, addRow, clear, el, fmtIsland, fmtP, fmtTime } from "./dom.js";

let current = null; // the case shown in the report

function caseUrl(id) {
  return `${location.origin}/console/cases/${encodeURIComponent(id)}`;
}

export function showCase(c) {
  current = c;
  $("case-report").hidden = false;
  $("case-error").textContent = "";
  $("case-id").textContent = c.case_id;
  const link = $("case-link");
  link.href = caseUrl(c.case_id);
  link.textContent = caseUrl(c.case_id);
  $("case-url-print").textContent = caseUrl(c.case_id);
  const v = $("case-verdict");
  v.textContent = c.sentence;
  v.className = "verdict " + ({ watermarked: "found", inconclusive: "unsure" }[c.verdict] || "clean");
  v.dataset.verdict = c.verdict;
  const tbody = $("case-table").querySelector("tbody");
  clear(tbody);
  const who = c.who || {};
  const by = who.role === "admin" ? "admin token"
    : `API key "${who.key_name}" (${who.key_id}) of tenant ${who.tenant_name} (${who.tenant_id})`;
  addRow(tbody, "verdict", HEADLINES[c.verdict] || c.verdict);
  addRow(tbody, "statistic", c.why);
  if (c.p_value !== null && c.p_value !== undefined) addRow(tbody, "p-value", fmtP(c.p_value));
  addRow(tbody, "mode", c.mode);
  addRow(tbody, "checked", fmtTime(c.created_at));
  addRow(tbody, "checked by", by);
  const s = c.summary || {};
  if (s.matched_tenant) addRow(tbody, "matched tenant", s.matched_tenant_name ? `${s.matched_tenant_name} (${s.matched_tenant})` : s.matched_tenant, true);
  if (s.key_version !== undefined && s.key_version !== null) addRow(tbody, "key version", s.key_version);
  if (s.message_id !== undefined && s.message_id !== null) addRow(tbody, "message id", s.message_id);
  if (s.issued_at) addRow(tbody, "issued", fmtTime(s.issued_at));
  addMetadataRows(tbody, s.metadata);
  if (s.num_tokens !== undefined) addRow(tbody, "tokens", `${s.num_scored_tokens} of ${s.num_tokens} scored`);
  if (s.islands && s.islands.length) {
    addRow(tbody, "watermarked stretches", s.islands.map((i) => "tokens " + fmtIsland(i)).join(", "));
  }
  if (c.source) addRow(tbody, "from", `${c.source.file}, row ${c.source.row} (${c.source.id})`, true);
  addRow(tbody, "text SHA-256", c.text_sha256, true);
  addRow(tbody, "characters", c.num_chars);
  addRow(tbody, "text kept", c.text_kept ? "yes" : "no (only its SHA-256)");
  if (c.expires_at) addRow(tbody, "kept until", fmtTime(c.expires_at));
  $("case-text-block").hidden = !c.text;
  $("case-text").textContent = c.text || "";
}

export async function openCase(id) {
  $("case-error").textContent = "";
  try {
    const c = await api("GET", "/console/api/cases/" + encodeURIComponent(id));
    $("result").hidden = true;
    showCase(c);
    $("case-verdict").setAttribute("tabindex", "-1");
    $("case-verdict").focus();
  } catch (err) {
    $("case-report").hidden = false;
    $("case-id").textContent = id;
    $("case-verdict").textContent = "";
    clear($("case-table").querySelector("tbody"));
    $("case-text-block").hidden = true;
    $("case-error").textContent = err.status === 404
      ? "No such case for this credential (it may have been deleted or expired, or it belongs to another tenant)."
      : err.message;
  }
}

export async function exportCase(fmt) {
  if (!current) return;
  try {
    await download(`/console/api/cases/${encodeURIComponent(current.case_id)}/export?format=${fmt}`,
      `case-${current.case_id}.${fmt}`);
  } catch (err) {
    $("case-error").textContent = err.message;
  }
}

export async function deleteCase() {
  if (!current) return;
  try {
    await api("DELETE", "/console/api/cases/" + encodeURIComponent(current.case_id));
    $("case-error").textContent = "";
    $("case-report").hidden = true;
    $("status").textContent = `Case ${current.case_id} deleted, with its text.`;
    current = null;
    loadHistory();
  } catch (err) {
    $("case-error").textContent = err.message;
  }
}

export function caseLink(id) {
  const a = el("a", id, "mono");
  a.href = caseUrl(id);
  a.addEventListener("click", (event) => {
    event.preventDefault();
    history.pushState(null, "", a.href);
    openCase(id);
  });
  return a;
}

export async function loadHistory() {
  const tbody = $("history-table").querySelector("tbody");
  $("history-error").textContent = "";
  try {
    const data = await api("GET", "/console/api/cases?limit=50");
    clear(tbody);
    for (const c of data.cases) {
      const tr = el("tr");
      const who = c.who || {};
      addCells(tr, [fmtTime(c.created_at), who.role === "admin" ? "(admin)" : who.tenant_name,
        who.role === "admin" ? "admin token" : who.key_name, c.mode, HEADLINES[c.verdict] || c.verdict,
        (c.summary && (c.summary.matched_tenant_name || c.summary.matched_tenant)) || ""]);
      const td = el("td");
      td.appendChild(caseLink(c.case_id));
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
  } catch (err) {
    $("history-error").textContent = err.message;
  }
}

