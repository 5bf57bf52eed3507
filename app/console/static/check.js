// The result of one check: the verdict headline (the server's verdict, with who and
// what was matched), the registry entry, the runners-up and the per-token evidence.
import { state } from "./api.js";
import { $, HEADLINES, addMetadataRows, addRow, clear, el, fmtP, fmtTime } from "./dom.js";
import { showChart, showHeatmap } from "./evidence.js";

// Why an answer names no registry entry, where the server says (null: no entry fits,
// or there are none).
function noEntryReason(data) {
  if (data && data.registry_ambiguous) {
    return "another entry fits the text almost as well (a longer excerpt may decide)";
  }
  if (data && data.registry_expired) return "its entry is past the tenant's retention";
  if (data && data.registry_withheld) {
    return "the spoof-artifact check flagged the text (its watermark sits in contexts " +
      "the tenant's texts use often, as a stolen watermark's does)";
  }
  return null;
}

// The headline word is the server's verdict (worldcup_core.verdict, the one verdict
// function); this adds who and what was matched, and the p-value where shown.
function verdictText(mode, data, verdict) {
  const head = HEADLINES[verdict] || verdict;
  const found = verdict === "watermarked";
  if (mode === "provenance") {
    if (data.reason === "no_agreement") {
      return [`${head}: the evidence does not agree within the key's cells, as a ` +
        `stolen watermark's does not (possible forgery; nothing is attributed), ` +
        `p = ${fmtP(data.p_value)}`, false];
    }
    if (data.reason === "too_short") {
      return [`${head}: too short to tell (${data.num_scored_tokens} scored tokens; ` +
        `${data.tokens_needed} needed), best p = ${fmtP(data.p_value)}`, false];
    }
    if (verdict === "inconclusive" && data.suspect) {
      const s = data.suspect;
      return [`${head} — some evidence for tenant ${s.tenant_name || s.tenant_id} ` +
        `(key version ${s.key_version}), not enough to say watermarked; ` +
        `p = ${fmtP(data.p_value)}`, false];
    }
    if (verdict === "not_watermarked" || !data.match) {
      return [`${head} (p = ${fmtP(data.p_value)})`, found];
    }
    const m = data.match;
    const parts = [`tenant ${m.tenant_name || m.tenant_id}`];
    if (m.registry_entry) {
      parts.push(entryName(m.registry_entry));
      if (m.registry_entry.issued_at) parts.push(`issued ${fmtTime(m.registry_entry.issued_at)}`);
    } else {
      parts.push(`key version ${m.key_version}, ${noEntryReason(m) ? `no entry named: ${noEntryReason(m)}` : "no registry entry matched"}`);
    }
    const keys = data.num_keys === 1 ? "1 key" : `${data.num_keys} keys`;
    parts.push(`p = ${fmtP(data.p_value)} (corrected for ${keys})`);
    return [`${head} — ` + parts.join(", "), found];
  }
  const session = state.session;
  const tenant = session && session.tenant_name ? `tenant ${session.tenant_name}` : "this tenant";
  if (data.detail === "verdict") {
    const entry = data.registry_match;
    let text = HEADLINES[data.verdict] || data.verdict;
    if (data.verdict === "watermarked") {
      text += ` — ${tenant}`;
      if (entry) text += `, ${entryName(entry)}` + (entry.issued_at ? `, issued ${fmtTime(entry.issued_at)}` : "");
    }
    const why = data.detail_reason === "full_answers_spent"
      ? "this text's full answers are spent for today: no p-value"
      : "verdict key: no p-value";
    return [text + ` (${why})`, data.verdict === "watermarked"];
  }
  if (verdict === "not_watermarked") return [`${head} (p = ${fmtP(data.p_value)})`, false];
  if (data.reason === "no_agreement") {
    return [`${head}: the evidence does not agree within the key's cells, as a ` +
      `stolen watermark's does not (possible forgery; nothing is attributed), ` +
      `p = ${fmtP(data.p_value)}`, false];
  }
  if (data.reason === "too_short") {
    return [`${head}: too short to tell (${data.num_scored_tokens} scored tokens; ` +
      `${data.tokens_needed} needed), p = ${fmtP(data.p_value)}`, false];
  }
  const parts = [tenant];
  if (data.key_version !== null && data.key_version !== undefined) parts.push(`key version ${data.key_version}`);
  const entry = data.registry_match;
  if (entry) {
    parts.push(entryName(entry));
    if (entry.issued_at) parts.push(`issued ${fmtTime(entry.issued_at)}`);
  }
  else if (noEntryReason(data)) parts.push(`no entry named: ${noEntryReason(data)}`);
  parts.push(`p = ${fmtP(data.p_value)}`);
  return [`${head} — ` + parts.join(", "), found];
}

// How an entry is named: its message id, or the client's own chosen payload.
function entryName(entry) {
  if (!entry.client_payload) return `message ${entry.message_id}`;
  // a client payload's bits only to keys that may choose payloads or are analysts
  const chosen = entry.bits ? `the client's own payload ${entry.bits}` : "a payload the client chose";
  // sealed (today's): in a registry entry of its own; before sealing: no entry
  return entry.message_id != null ? `message ${entry.message_id} (${chosen})` : chosen;
}

// The share of the text that carries the watermark (the answer's coverage), in words.
function coverageText(data) {
  const c = data.coverage;
  if (!c) return "";
  const pct = `${Math.round(100 * c.share)} %`;
  return c.attribution === "whole"
    ? ` The watermark spans the whole text (${pct} of the scored tokens).`
    : ` Only part of the text carries the watermark (${pct} of the scored tokens, ` +
      `${c.islands.map((i) => `tokens ${i.start}–${i.end}`).join(", ")}): the rest is not the issued text.`;
}

export function show(mode, data, text, saved) {
  $("result").hidden = false;
  const [words, found] = verdictText(mode, data, saved.verdict);
  $("verdict-rule").textContent = `${saved.sentence}. Statistic: ${saved.why}.`;
  const verdict = $("verdict");
  verdict.textContent = words;
  verdict.className = "verdict " + (found ? "found" : (saved.verdict === "inconclusive" ? "unsure" : "clean"));
  verdict.dataset.found = String(found);
  const scored = data.num_scored_tokens !== undefined
    ? `${data.num_scored_tokens} of ${data.num_tokens} tokens scored.` : "";
  $("summary").textContent = scored + coverageText(data);

  const entry = mode === "provenance"
    ? (data.match ? data.match.registry_entry : null)
    : (data.registry_match || null);
  showEntry(mode, data, entry);
  showRunners(mode, data);
  showHeatmap(mode, data, text);
  showChart(mode, data);
  verdict.focus();
}

function showEntry(mode, data, entry) {
  const tbody = $("metadata").querySelector("tbody");
  clear(tbody);
  $("metadata").hidden = !entry;
  $("metadata-none").hidden = Boolean(entry) || mode === "detect";
  const reason = noEntryReason(mode === "provenance" ? data.match : data);
  $("metadata-none").textContent = reason
    ? `No registry entry was named: ${reason}.`
    : "No registry entry was matched.";
  if (mode === "provenance" && data.match) {
    addRow(tbody, "tenant", data.match.tenant_name || "");
    addRow(tbody, "tenant id", data.match.tenant_id, true);
    addRow(tbody, "key version", data.match.key_version);
    addRow(tbody, "decoded bits", data.match.bits, true);
    $("metadata").hidden = false;
  }
  if (!entry) return;
  if (entry.client_payload) {
    addRow(tbody, "client's own payload", entry.bits || "(bits shown to analysts' keys only)", true);
  }
  if (entry.message_id != null) {
    addRow(tbody, "message id", entry.message_id);
    addRow(tbody, "issued", fmtTime(entry.issued_at));
  }
  if (entry.confidence !== undefined) {
    addRow(tbody, "registry confidence", entry.confidence.toFixed(3));
    addRow(tbody, "registry p", fmtP(entry.p_value));
    addRow(tbody, "bits exact", entry.exact ? "yes" : "no (bit errors corrected by the registry)");
  }
  addMetadataRows(tbody, entry.metadata);
}

function showRunners(mode, data) {
  const block = $("runners-block");
  const tbody = $("runners-up").querySelector("tbody");
  clear(tbody);
  block.hidden = mode !== "provenance";
  if (mode !== "provenance") return;
  const rows = data.found ? data.candidates.slice(1) : data.candidates;
  rows.forEach((c, i) => {
    const tr = el("tr");
    tr.appendChild(el("td", String(i + (data.found ? 2 : 1))));
    tr.appendChild(el("td", c.tenant_name || c.tenant_id, c.tenant_name ? "" : "mono"));
    tr.appendChild(el("td", c.key_version));
    tr.appendChild(el("td", fmtP(c.p_value)));
    tbody.appendChild(tr);
  });
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "none");
    td.colSpan = 4;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

