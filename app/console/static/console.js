// WorldCup provenance console. Plain JavaScript ES modules, no dependencies, loaded
// under a CSP of script-src 'self'. Every text from the user or the service is put in
// the page with textContent, never parsed as HTML. The credential lives in
// sessionStorage. This module signs in and out, runs a check and wires the page;
// check.js and evidence.js render a result, cases.js the saved cases, batch.js batches.
import { STORE, api, credential, forget, state } from "./api.js";
import { exportBatch, loadBatchFile, readTogether, renderBatch, resetBatch, runBatch, sortBy } from "./batch.js";
import { show } from "./check.js";
import { deleteCase, exportCase, loadHistory, openCase, showCase } from "./cases.js";
import { $, addCells, clear, el, fmtP, fmtTime } from "./dom.js";
import { hideTip, moveFocus } from "./evidence.js";

// ------------------------------------------------------------------ sign in / out
async function signIn(event) {
  event.preventDefault();
  const input = $("api-key");
  const value = input.value.trim();
  $("signin-error").textContent = "";
  if (!value) {
    $("signin-error").textContent = "Paste an API key or the admin token first.";
    input.focus();
    return;
  }
  sessionStorage.setItem(STORE, value);
  input.value = "";
  try {
    await startSession();
  } catch (err) {
    forget();
    $("signin-error").textContent = err.status === 401
      ? "This credential was refused: " + err.message.replace(/^Refused \(HTTP 401\): /, "")
      : err.message;
    input.focus();
  }
}

async function startSession() {
  const me = await api("GET", "/console/session");
  const usable = ["provenance", "decode", "detect"].filter((s) => me.scopes.includes(s));
  if (!usable.length) {
    throw new Error("This API key has none of the provenance, decode or detect scopes: " +
      "ask an admin for a key with the provenance scope.");
  }
  state.session = me;
  const session = me;
  const who = session.role === "admin"
    ? "admin"
    : `API key of tenant ${session.tenant_name} (${session.scopes.join(", ")}; ${session.detail})`;
  $("who").textContent = who;
  $("signin").hidden = true;
  $("session-bar").hidden = false;
  $("workspace").hidden = false;
  const isAdmin = session.role === "admin";
  for (const mode of ["decode", "detect"]) {
    const radio = document.querySelector(`input[name=mode][value=${mode}]`);
    radio.disabled = isAdmin || !session.scopes.includes(mode);
  }
  const prov = document.querySelector("input[name=mode][value=provenance]");
  prov.disabled = !session.scopes.includes("provenance");
  const first = document.querySelector("input[name=mode]:not(:disabled)");
  if (first) first.checked = true;
  $("audit").hidden = !isAdmin;
  if (isAdmin) loadAudit();
  $("history-scope").textContent = isAdmin
    ? "Every tenant's cases (admin), newest first."
    : `Cases of tenant ${session.tenant_name}, newest first.`;
  loadHistory();
  const caseId = document.body.dataset.caseId;
  if (caseId) {
    await openCase(caseId);
  } else {
    $("text-input").focus();
  }
}

function signOut() {
  forget();
  state.session = null;
  $("text-input").value = "";
  $("result").hidden = true;
  $("workspace").hidden = true;
  $("session-bar").hidden = true;
  $("audit").hidden = true;
  $("case-report").hidden = true;
  $("batch-results").hidden = true;
  $("together").hidden = true;
  resetBatch();
  clear($("history-table").querySelector("tbody"));
  clear($("batch-table").querySelector("tbody"));
  clear($("heatmap"));
  clear($("position-chart"));
  $("signin").hidden = false;
  $("check-error").textContent = "";
  $("api-key").focus();
}

// ------------------------------------------------------------------ checking
async function loadFile() {
  const file = $("file-input").files[0];
  if (!file) return;
  $("text-input").value = await file.text();
  $("status").textContent = `Loaded ${file.name} (${file.size} bytes).`;
}

async function runCheck(event) {
  event.preventDefault();
  const text = $("text-input").value;
  $("check-error").textContent = "";
  if (!text.trim()) {
    $("check-error").textContent = "Paste a text or load a .txt file first.";
    $("text-input").focus();
    return;
  }
  const mode = document.querySelector("input[name=mode]:checked").value;
  const admin = state.session && state.session.role === "admin";
  const button = $("run");
  button.disabled = true;
  $("status").textContent = "Checking…";
  try {
    // the server runs the same check as /provenance, /decode or /detect (with the
    // per-token evidence this credential may see) and saves it as a case
    const out = await api("POST", "/console/api/cases", { text, mode, keep_text: $("keep-text").checked });
    show(mode, out.result, text, out.case);
    showCase(out.case);
    $("status").textContent = "Done.";
    if (admin && mode === "provenance") loadAudit();
    loadHistory();
  } catch (err) {
    $("status").textContent = "";
    $("check-error").textContent = err.message;
    if (err.status === 401) $("check-error").textContent += " Sign out and sign in again.";
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ audit
async function loadAudit() {
  const tbody = $("audit-table").querySelector("tbody");
  $("audit-error").textContent = "";
  try {
    const data = await api("GET", "/admin/audit?limit=20");
    clear(tbody);
    for (const e of data.entries) {
      const o = e.outcome || {};
      const tr = el("tr");
      addCells(tr, [fmtTime(e.at), e.actor, e.action,
        o.found === undefined ? "" : (o.found ? "yes" : "no"),
        o.tenant_id || "", o.message_id ?? "", o.p_value === undefined ? "" : fmtP(o.p_value)]);
      tbody.appendChild(tr);
    }
  } catch (err) {
    $("audit-error").textContent = err.message;
  }
}

// ------------------------------------------------------------------ wiring
document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("check-form").addEventListener("submit", runCheck);
  $("file-input").addEventListener("change", loadFile);
  $("audit-refresh").addEventListener("click", loadAudit);
  $("heatmap").addEventListener("keydown", moveFocus);
  $("case-export-json").addEventListener("click", () => exportCase("json"));
  $("case-export-csv").addEventListener("click", () => exportCase("csv"));
  $("case-print").addEventListener("click", () => window.print());
  $("case-delete").addEventListener("click", deleteCase);
  $("history-refresh").addEventListener("click", loadHistory);
  $("batch-file").addEventListener("change", loadBatchFile);
  $("batch-run").addEventListener("click", runBatch);
  $("together-run").addEventListener("click", readTogether);
  $("batch-filter-verdict").addEventListener("change", renderBatch);
  $("batch-filter-text").addEventListener("input", renderBatch);
  $("batch-table").querySelector("thead").addEventListener("click", sortBy);
  $("batch-export-csv").addEventListener("click", () => exportBatch("csv"));
  $("batch-export-json").addEventListener("click", () => exportBatch("json"));
  if (credential()) {
    startSession().catch((err) => {
      forget();
      $("signin-error").textContent = err.message;
    });
  }
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") hideTip();
  });
});
