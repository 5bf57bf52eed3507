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
    $("text-input").focus();
  }

  function signOut() {
    sessionStorage.removeItem(STORE);
    session = null;
    $("text-input").value = "";
    $("result").hidden = true;
    $("workspace").hidden = true;
    $("session-bar").hidden = true;
    $("audit").hidden = true;
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
    const analyst = session && session.detail === "full" && session.scopes.includes("provenance");
    const wantEvidence = mode === "provenance" ? admin : mode === "decode" && analyst;
    const button = $("run");
    button.disabled = true;
    $("status").textContent = "Checking…";
    try {
      const payload = mode === "detect" ? { text } : { text, evidence: wantEvidence };
      const data = await api("POST", "/" + mode, payload);
      show(mode, data, text);
      $("status").textContent = "Done.";
      if (admin && mode === "provenance") loadAudit();
    } catch (err) {
      $("status").textContent = "";
      $("check-error").textContent = err.message;
      if (err.status === 401) $("check-error").textContent += " Sign out and sign in again.";
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------ rendering
  function verdictText(mode, data) {
    if (mode === "provenance") {
      if (!data.found) return [`No watermark found (best p = ${fmtP(data.p_value)})`, false];
      const m = data.match;
      const parts = [`tenant ${m.tenant_name || m.tenant_id}`];
      if (m.registry_entry) {
        parts.push(`message ${m.registry_entry.message_id}`);
        parts.push(`issued ${fmtTime(m.registry_entry.issued_at)}`);
      } else {
        parts.push(`key version ${m.key_version}, no registry entry matched`);
      }
      const keys = data.num_keys === 1 ? "1 key" : `${data.num_keys} keys`;
      parts.push(`p = ${fmtP(data.p_value)} (corrected for ${keys})`);
      return ["Watermarked — " + parts.join(", "), true];
    }
    const tenant = session && session.tenant_name ? `tenant ${session.tenant_name}` : "this tenant";
    if (data.detail === "verdict") {
      const entry = data.registry_match;
      const words = { watermarked: "Watermarked", not_watermarked: "No watermark found", inconclusive: "Inconclusive" };
      let text = words[data.verdict] || data.verdict;
      if (data.verdict === "watermarked") {
        text += ` — ${tenant}`;
        if (entry) text += `, message ${entry.message_id}, issued ${fmtTime(entry.issued_at)}`;
      }
      return [text + " (verdict key: no p-value)", data.verdict === "watermarked"];
    }
    if (!data.is_watermarked) return [`No watermark found (p = ${fmtP(data.p_value)})`, false];
    const parts = [tenant, `key version ${data.key_version}`];
    const entry = data.registry_match;
    if (entry) parts.push(`message ${entry.message_id}`, `issued ${fmtTime(entry.issued_at)}`);
    parts.push(`p = ${fmtP(data.p_value)}`);
    return ["Watermarked — " + parts.join(", "), true];
  }

  function show(mode, data, text) {
    $("result").hidden = false;
    const [words, found] = verdictText(mode, data);
    const verdict = $("verdict");
    verdict.textContent = words;
    verdict.className = "verdict " + (found ? "found" : "clean");
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
