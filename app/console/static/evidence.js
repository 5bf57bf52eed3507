// The per-token evidence of one check: the heatmap over the text (with its keyboard
// navigation and tooltip), where the watermark is, and the bit-confidence chart.
import { $, clear, el, fmtIsland, svg } from "./dom.js";

const groupsDefault = Number(document.body.dataset.groups || "2");

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

export function hideTip() {
  $("tooltip").hidden = true;
}

export function showHeatmap(mode, data, text) {
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
  $("heatmap-note").textContent = heatmapNote(data, ev);
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
  if (ev.matched) {
    $("islands").textContent = data.verdict === "watermarked"
      ? islandsText(ev.islands || [], ev.tokens.length)
      : "The evidence is too weak to say where a watermark would sit.";
  }
}

export function moveFocus(event) {
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
// What the heatmap shows, in words that agree with the verdict above it.
function heatmapNote(data, ev) {
  if (ev.matched && data.verdict === "inconclusive") {
    const s = data.suspect;
    const whose = s ? ` (tenant ${s.tenant_name || s.tenant_id})` : "";
    return `Evidence for the best key${whose}: some, not enough to say watermarked.`;
  }
  if (ev.matched) return "Evidence for the best key.";
  if (data.verdict === "inconclusive") {
    return "Too little evidence to colour the tokens under any one key.";
  }
  return "No key matched: the tokens carry no evidence for any key.";
}

function islandsText(islands, length) {
  if (!islands.length) return "Too few scored tokens to say where the watermark is.";
  if (islands.length === 1 && islands[0].start === 0 && islands[0].end >= length - 1) {
    return `The whole text carries the watermark (tokens 0–${length - 1}, ` +
      `mean z ${islands[0].mean_z.toFixed(2)}).`;
  }
  return "Watermark evidence concentrated in tokens " +
    islands.map(fmtIsland).join(", ") +
    ` of ${length}.`;
}

export function showChart(mode, data) {
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
  if (!bits && mode === "decode" && data.bits === null) {  // withheld: app.services.disclosure
    box.appendChild(el("p", "Decoded bits are shown to analysts' keys only (the provenance " +
      "scope): payload bits are what a watermark-stealing attacker learns from. The " +
      "verdict and the registry entry above are this key's answer.", "help"));
    return;
  }
  if (!bits || !bits.length) {
    box.appendChild(el("p", mode === "detect"
      ? "Detect does not decode a message."
      : (data.reason === "too_short"
        ? "Too short to decode a message."
        : "No key's evidence was strong enough to decode a message under it."), "help"));
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

