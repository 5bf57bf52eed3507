// WorldCup provenance console. Plain JavaScript, no dependencies, loaded under a
// CSP of script-src 'self'. Every text from the user or the service is put in the
// page with textContent, never parsed as HTML. The credential lives in sessionStorage.
"use strict";

(function () {
  const STORE = "worldcup.console.credential";
  const body = document.body;
  const groupsDefault = Number(body.dataset.groups || "2");
  const $ = (id) => document.getElementById(id);
  let session = null; // {role, tenant_name, scopes, detail}

  // ------------------------------------------------------------------ helpers
  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function fmtP(p) {
    if (p === null || p === undefined) return "n/a";
    if (p === 0) return "< 1e-300";
    if (p < 1e-3) return p.toExponential(1);
    return p.toPrecision(2);
  }

  function fmtTime(iso) {
    const d = new Date(iso);
    if (isNaN(d.getTime())) return String(iso);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
      `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())} UTC`;
  }

  function credential() {
    return sessionStorage.getItem(STORE);
  }

  async function api(method, path, payload) {
    const headers = { Authorization: "Bearer " + credential() };
    if (payload !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: payload === undefined ? undefined : JSON.stringify(payload),
        credentials: "omit",
        cache: "no-store",
        referrerPolicy: "no-referrer",
      });
    } catch (err) {
      throw new Error("The service could not be reached (" + err.message + ").");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      const detail = data && data.error ? data.error.message : response.statusText;
      const error = new Error(`Refused (HTTP ${response.status}): ${detail}`);
      error.status = response.status;
      throw error;
    }
    return data;
  }

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
      sessionStorage.removeItem(STORE);
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
    session = me;
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
    const caseId = body.dataset.caseId;
    if (caseId) {
      await openCase(caseId);
    } else {
      $("text-input").focus();
    }
  }

  function signOut() {
    sessionStorage.removeItem(STORE);
    session = null;
    $("text-input").value = "";
    $("result").hidden = true;
    $("workspace").hidden = true;
    $("session-bar").hidden = true;
    $("audit").hidden = true;
    $("case-report").hidden = true;
    $("batch-results").hidden = true;
    batch = null;
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
    const admin = session && session.role === "admin";
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

  // ------------------------------------------------------------------ rendering
  const HEADLINES = { watermarked: "Watermarked", not_watermarked: "No watermark found", inconclusive: "Inconclusive" };

  // The headline word is the server's verdict (worldcup_core.verdict, the one verdict
  // function); this adds who and what was matched, and the p-value where shown.
  function verdictText(mode, data, verdict) {
    const head = HEADLINES[verdict] || verdict;
    const found = verdict === "watermarked";
    if (mode === "provenance") {
      if (verdict === "not_watermarked" || !data.match) {
        return [`${head} (best p = ${fmtP(data.verdict_p_value)})`, found];
      }
      const m = data.match;
      const parts = [`tenant ${m.tenant_name || m.tenant_id}`];
      if (m.registry_entry) {
        parts.push(`message ${m.registry_entry.message_id}`);
        parts.push(`issued ${fmtTime(m.registry_entry.issued_at)}`);
      } else {
        parts.push(`key version ${m.key_version}, no registry entry matched`);
      }
      const keys = data.num_keys === 1 ? "1 key" : `${data.num_keys} keys`;
      parts.push(`p = ${fmtP(data.verdict_p_value)} (corrected for ${keys})`);
      return [`${head} — ` + parts.join(", "), found];
    }
    const tenant = session && session.tenant_name ? `tenant ${session.tenant_name}` : "this tenant";
    if (data.detail === "verdict") {
      const entry = data.registry_match;
      let text = HEADLINES[data.verdict] || data.verdict;
      if (data.verdict === "watermarked") {
        text += ` — ${tenant}`;
        if (entry) text += `, message ${entry.message_id}, issued ${fmtTime(entry.issued_at)}`;
      }
      return [text + " (verdict key: no p-value)", data.verdict === "watermarked"];
    }
    if (verdict === "not_watermarked") return [`${head} (p = ${fmtP(data.verdict_p_value)})`, false];
    const parts = [tenant];
    if (data.key_version !== null && data.key_version !== undefined) parts.push(`key version ${data.key_version}`);
    const entry = data.registry_match;
    if (entry) parts.push(`message ${entry.message_id}`, `issued ${fmtTime(entry.issued_at)}`);
    parts.push(`p = ${fmtP(data.verdict_p_value)}`);
    return [`${head} — ` + parts.join(", "), found];
  }

  function show(mode, data, text, saved) {
    $("result").hidden = false;
    const [words, found] = verdictText(mode, data, saved.verdict);
    $("verdict-rule").textContent = `${saved.sentence}. Statistic: ${saved.why}.`;
    const verdict = $("verdict");
    verdict.textContent = words;
    verdict.className = "verdict " + (found ? "found" : (saved.verdict === "inconclusive" ? "unsure" : "clean"));
    verdict.dataset.found = String(found);
    const scored = data.num_scored_tokens !== undefined
      ? `${data.num_scored_tokens} of ${data.num_tokens} tokens scored.` : "";
    $("summary").textContent = scored;

    const entry = mode === "provenance"
      ? (data.match ? data.match.registry_entry : null)
      : (data.registry_match || null);
    showEntry(mode, data, entry);
    showRunners(mode, data);
    showHeatmap(mode, data, text);
    showChart(mode, data);
    verdict.focus();
  }

  function addRow(tbody, key, value, mono) {
    const tr = el("tr");
    const th = el("th", key);
    th.scope = "row";
    tr.appendChild(th);
    tr.appendChild(el("td", value, mono ? "mono" : ""));
    tbody.appendChild(tr);
  }

  function showEntry(mode, data, entry) {
    const tbody = $("metadata").querySelector("tbody");
    clear(tbody);
    $("metadata").hidden = !entry;
    $("metadata-none").hidden = Boolean(entry) || mode === "detect";
    if (mode === "provenance" && data.match) {
      addRow(tbody, "tenant", data.match.tenant_name || "");
      addRow(tbody, "tenant id", data.match.tenant_id, true);
      addRow(tbody, "key version", data.match.key_version);
      addRow(tbody, "decoded bits", data.match.bits, true);
      $("metadata").hidden = false;
    }
    if (!entry) return;
    addRow(tbody, "message id", entry.message_id);
    addRow(tbody, "issued", fmtTime(entry.issued_at));
    if (entry.confidence !== undefined) {
      addRow(tbody, "registry confidence", entry.confidence.toFixed(3));
      addRow(tbody, "registry p", fmtP(entry.p_value));
      addRow(tbody, "bits exact", entry.exact ? "yes" : "no (bit errors corrected by the registry)");
    }
    for (const [key, value] of Object.entries(entry.metadata || {})) {
      addRow(tbody, "metadata: " + key, typeof value === "string" ? value : JSON.stringify(value), true);
    }
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
      tr.appendChild(el("td", c.tenant_id, "mono"));
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

  function heat(z) {
    const c = Math.max(-3, Math.min(3, z)) / 3;
    const rgb = c >= 0 ? "214, 94, 0" : "25, 103, 210";
    return `rgba(${rgb}, ${(Math.abs(c) * 0.6).toFixed(3)})`;
  }

  function describe(tok) {
    if (!tok.scored) return `token ${tok.index}: not scored (first tokens or a repeated context)`;
    const g = tok.g_mean.map((x) => x.toFixed(2)).join(" / ");
    const z = tok.z === null ? "no reference (alone in its cells)" : tok.z.toFixed(2);
    return `token ${tok.index}: message position ${tok.position}, g-mean ${g}, z ${z}`;
  }

  function showTip(node, text) {
    const tip = $("tooltip");
    tip.textContent = text;
    tip.hidden = false;
    const r = node.getBoundingClientRect();
    tip.style.left = Math.max(4, Math.min(r.left, window.innerWidth - 360)) + "px";
    tip.style.top = (r.bottom + 6) + "px";
  }

  function hideTip() {
    $("tooltip").hidden = true;
  }

  function showHeatmap(mode, data, text) {
    const map = $("heatmap");
    clear(map);
    $("islands").textContent = "";
    $("token-detail").textContent = "";
    const ev = data.evidence;
    if (!ev) {
      const why = mode === "detect"
        ? "Detect answers yes or no: no per-token evidence."
        : (mode === "provenance"
          ? "Per-token evidence of a provenance search needs the admin token."
          : "Per-token evidence needs a full API key that also holds the provenance scope.");
      $("heatmap-note").textContent = why;
      map.appendChild(el("span", text, "tok unscored"));
      return;
    }
    $("heatmap-note").textContent = ev.matched
      ? "Evidence for the best key."
      : "No key matched: the tokens carry no evidence for any key.";
    ev.tokens.forEach((tok, i) => {
      const span = el("span", tok.text, "tok");
      span.dataset.tokenIndex = String(tok.index);
      span.dataset.scored = String(tok.scored);
      if (tok.scored) {
        span.dataset.position = String(tok.position);
        span.dataset.gMean = tok.g_mean.join(",");
      }
      if (tok.z !== null) {
        span.dataset.z = String(tok.z);
        span.style.backgroundColor = heat(tok.z);
        if (tok.z >= 2) span.classList.add("strong");
      } else if (!ev.matched) {
        span.classList.add("nokey");
      } else if (!tok.scored) {
        span.classList.add("unscored");
      }
      span.tabIndex = i === 0 ? 0 : -1;
      span.setAttribute("aria-label", describe(tok));
      span.addEventListener("mouseenter", () => showTip(span, describe(tok)));
      span.addEventListener("mouseleave", hideTip);
      span.addEventListener("focus", () => {
        showTip(span, describe(tok));
        $("token-detail").textContent = describe(tok);
      });
      span.addEventListener("blur", hideTip);
      map.appendChild(span);
    });
    if (ev.matched) $("islands").textContent = islandsText(ev.islands || [], ev.tokens.length);
  }

  function moveFocus(event) {
    const tokens = Array.from($("heatmap").querySelectorAll(".tok[data-token-index]"));
    const at = tokens.indexOf(document.activeElement);
    if (at < 0) return;
    const step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[event.key];
    let next = null;
    if (step) next = Math.max(0, Math.min(tokens.length - 1, at + step));
    if (event.key === "Home") next = 0;
    if (event.key === "End") next = tokens.length - 1;
    if (next === null) return;
    event.preventDefault();
    tokens[at].tabIndex = -1;
    tokens[next].tabIndex = 0;
    tokens[next].focus();
  }

  // The server's islands (worldcup_core.islands): where the watermark is, as text.
  function islandsText(islands, length) {
    if (!islands.length) return "Too few scored tokens to say where the watermark is.";
    if (islands.length === 1 && islands[0].start === 0 && islands[0].end >= length - 1) {
      return `The whole text carries the watermark (tokens 0–${length - 1}, ` +
        `mean z ${islands[0].mean_z.toFixed(2)}).`;
    }
    return "Watermark evidence concentrated in tokens " +
      islands.map((i) => `${i.start}–${i.end} (mean z ${i.mean_z.toFixed(2)})`).join(", ") +
      ` of ${length}.`;
  }

  function showChart(mode, data) {
    const box = $("position-chart");
    clear(box);
    const tbody = $("bits-table").querySelector("tbody");
    clear(tbody);
    let bits = null;
    let groups = groupsDefault;
    if (data.evidence && data.evidence.matched) {
      bits = data.evidence.bits;
      groups = data.evidence.groups;
    } else if (data.bit_confidence) {
      bits = data.bit_confidence.map((b, i) => ({
        index: i, position: Math.floor(i / groups), group: i % groups,
        bit: data.bits[i], z: b.z, erased: data.erasures.includes(i),
      }));
    }
    if (!bits || !bits.length) {
      box.appendChild(el("p", mode === "detect"
        ? "Detect does not decode a message."
        : "No decoded message to chart.", "help"));
      return;
    }
    const bar = 14, gap = 10, height = 160, top = 10, left = 34;
    const positions = Math.ceil(bits.length / groups);
    const width = left + positions * (groups * bar + gap) + 10;
    const zMax = Math.max(4, ...bits.map((b) => b.z));
    const scale = (height - top) / zMax;
    const total = height + 54;
    const svgWidth = Math.max(width + 44, 360);
    const root = svg("svg", { width: svgWidth, height: total, viewBox: `0 0 ${svgWidth} ${total}` });
    root.appendChild(svg("title", {})).textContent = "Bit confidence per message position";
    const defs = svg("defs");
    const pattern = svg("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
    pattern.appendChild(svg("rect", { width: 6, height: 6, fill: "#e4e4e4" }));
    pattern.appendChild(svg("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#6b6b6b", "stroke-width": 2 }));
    defs.appendChild(pattern);
    root.appendChild(defs);
    root.appendChild(svg("line", { x1: left, y1: height, x2: width, y2: height, class: "axis" }));
    root.appendChild(svg("line", { x1: left, y1: top, x2: left, y2: height, class: "axis" }));
    for (const tick of [0, 2, 4, Math.floor(zMax)]) {
      const y = height - tick * scale;
      const label = svg("text", { x: left - 6, y: y + 4, "text-anchor": "end" });
      label.textContent = String(tick);
      root.appendChild(label);
    }
    const two = svg("line", { x1: left, y1: height - 2 * scale, x2: width, y2: height - 2 * scale, class: "threshold" });
    root.appendChild(two);
    for (const b of bits) {
      const x = left + 6 + b.position * (groups * bar + gap) + b.group * bar;
      const h = b.erased ? height - top : Math.max(1, b.z * scale);
      const rect = svg("rect", {
        x, y: height - h, width: bar - 2, height: h,
        class: b.erased ? "erased" : "g" + (b.group % 4),
        "data-bit-index": b.index, "data-position": b.position, "data-group": b.group,
        "data-erased": String(b.erased),
      });
      const title = svg("title");
      title.textContent = b.erased
        ? `bit ${b.index} (position ${b.position}, group ${b.group}): erased, no token`
        : `bit ${b.index} (position ${b.position}, group ${b.group}) = ${b.bit}, z ${b.z.toFixed(2)}`;
      rect.appendChild(title);
      root.appendChild(rect);
      const value = svg("text", { x: x + (bar - 2) / 2, y: height + 12, "text-anchor": "middle" });
      value.textContent = b.erased ? "?" : b.bit;
      root.appendChild(value);
      const tr = el("tr");
      for (const cell of [b.index, b.position, b.group, b.erased ? "? (erased)" : b.bit, b.z.toFixed(2)]) {
        tr.appendChild(el("td", cell));
      }
      tbody.appendChild(tr);
    }
    for (let p = 0; p < positions; p++) {
      const label = svg("text", { x: left + 6 + p * (groups * bar + gap) + (groups * bar) / 2, y: height + 28, "text-anchor": "middle" });
      label.textContent = "p" + p;
      root.appendChild(label);
    }
    const legend = Array.from({ length: Math.min(groups, 4) }, (_, g) => ["g" + g, "group " + g]);
    legend.push(["erased", "erased (?)"]);
    legend.forEach(([cls, name], i) => {
      const x = left + 10 + i * 90;
      root.appendChild(svg("rect", { x, y: height + 34, width: 12, height: 12, class: cls }));
      const label = svg("text", { x: x + 16, y: height + 44 });
      label.textContent = name;
      root.appendChild(label);
    });
    const zLabel = svg("text", { x: width + 4, y: height - 2 * scale + 4 });
    zLabel.textContent = "z = 2";
    root.appendChild(zLabel);
    box.setAttribute("aria-label",
      `Bit confidence: ${bits.length} bits on ${positions} positions, ` +
      `${bits.filter((b) => b.erased).length} erased; the table after it lists every bit.`);
    box.appendChild(root);
  }

  // ------------------------------------------------------------------ cases
  let current = null; // the case shown in the report
  let batch = null; // {batch_id, file, rows}
  let sortKey = "row";
  let sortDir = 1;

  function caseUrl(id) {
    return `${location.origin}/console/cases/${encodeURIComponent(id)}`;
  }

  function showCase(c) {
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
    for (const [key, value] of Object.entries(s.metadata || {})) {
      addRow(tbody, "metadata: " + key, typeof value === "string" ? value : JSON.stringify(value), true);
    }
    if (s.num_tokens !== undefined) addRow(tbody, "tokens", `${s.num_scored_tokens} of ${s.num_tokens} scored`);
    if (s.islands && s.islands.length) {
      addRow(tbody, "watermarked stretches", s.islands.map((i) => `tokens ${i.start}–${i.end} (mean z ${i.mean_z.toFixed(2)})`).join(", "));
    }
    if (c.source) addRow(tbody, "from", `${c.source.file}, row ${c.source.row} (${c.source.id})`, true);
    addRow(tbody, "text SHA-256", c.text_sha256, true);
    addRow(tbody, "characters", c.num_chars);
    addRow(tbody, "text kept", c.text_kept ? "yes" : "no (only its SHA-256)");
    if (c.expires_at) addRow(tbody, "kept until", fmtTime(c.expires_at));
    $("case-text-block").hidden = !c.text;
    $("case-text").textContent = c.text || "";
  }

  async function openCase(id) {
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

  async function download(path, name) {
    const response = await fetch(path, {
      headers: { Authorization: "Bearer " + credential() },
      credentials: "omit", cache: "no-store", referrerPolicy: "no-referrer",
    });
    if (!response.ok) throw new Error(`Refused (HTTP ${response.status})`);
    const blob = await response.blob();
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  }

  async function exportCase(fmt) {
    if (!current) return;
    try {
      await download(`/console/api/cases/${encodeURIComponent(current.case_id)}/export?format=${fmt}`,
        `case-${current.case_id}.${fmt}`);
    } catch (err) {
      $("case-error").textContent = err.message;
    }
  }

  async function deleteCase() {
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

  function caseLink(id) {
    const a = el("a", id, "mono");
    a.href = caseUrl(id);
    a.addEventListener("click", (event) => {
      event.preventDefault();
      history.pushState(null, "", a.href);
      openCase(id);
    });
    return a;
  }

  async function loadHistory() {
    const tbody = $("history-table").querySelector("tbody");
    $("history-error").textContent = "";
    try {
      const data = await api("GET", "/console/api/cases?limit=50");
      clear(tbody);
      for (const c of data.cases) {
        const tr = el("tr");
        const who = c.who || {};
        for (const cell of [fmtTime(c.created_at), who.role === "admin" ? "(admin)" : who.tenant_name,
          who.role === "admin" ? "admin token" : who.key_name, c.mode, HEADLINES[c.verdict] || c.verdict,
          (c.summary && (c.summary.matched_tenant_name || c.summary.matched_tenant)) || ""]) {
          tr.appendChild(el("td", cell));
        }
        const td = el("td");
        td.appendChild(caseLink(c.case_id));
        tr.appendChild(td);
        tbody.appendChild(tr);
      }
    } catch (err) {
      $("history-error").textContent = err.message;
    }
  }

  // ------------------------------------------------------------------ batches
  let batchFile = null;

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

  async function loadBatchFile() {
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
    $("batch-status").textContent = columns.length
      ? `Loaded ${file.name}: choose the column that holds the texts.`
      : "";
    if (!columns.length) $("batch-error").textContent = "No columns found: is it a CSV with a header row, or JSONL objects?";
  }

  async function runBatch() {
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

  function renderBatch() {
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
      for (const cell of cells) tr.appendChild(el("td", cell));
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

  function sortBy(event) {
    const button = event.target.closest("button[data-sort]");
    if (!button) return;
    const key = button.dataset.sort;
    sortDir = key === sortKey ? -sortDir : 1;
    sortKey = key;
    renderBatch();
  }

  async function exportBatch(fmt) {
    if (!batch) return;
    try {
      await download(`/console/api/cases/export?format=${fmt}&batch_id=${encodeURIComponent(batch.batch_id)}`,
        `batch-${batch.batch_id}.${fmt}`);
    } catch (err) {
      $("batch-error").textContent = err.message;
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
        for (const cell of [fmtTime(e.at), e.actor, e.action,
          o.found === undefined ? "" : (o.found ? "yes" : "no"),
          o.tenant_id || "", o.message_id ?? "", o.p_value === undefined ? "" : fmtP(o.p_value)]) {
          tr.appendChild(el("td", cell));
        }
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
    $("batch-filter-verdict").addEventListener("change", renderBatch);
    $("batch-filter-text").addEventListener("input", renderBatch);
    $("batch-table").querySelector("thead").addEventListener("click", sortBy);
    $("batch-export-csv").addEventListener("click", () => exportBatch("csv"));
    $("batch-export-json").addEventListener("click", () => exportBatch("json"));
    if (credential()) {
      startSession().catch((err) => {
        sessionStorage.removeItem(STORE);
        $("signin-error").textContent = err.message;
      });
    }
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape") hideTip();
    });
  });
})();
