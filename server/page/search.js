// The search page: one POST /v1/search, rendered with DOM calls only (passage text goes in
// as textContent, never as HTML). Explanations cost a pass of their own, so they are asked for
// only when the "explain matches" box is ticked; the choice is remembered in localStorage.
"use strict";

const KEY_STORAGE = "espn-api-key";
const EXPLAIN_STORAGE = "espn-explain";

const $ = (id) => document.getElementById(id);
let pending = null; // the request body waiting for an API key

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function optionalInt(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function requestBody() {
  const body = {
    query: $("query").value,
    k: optionalInt("k") ?? 10,
    prefetch: $("prefetch").checked,
    return_text: true,
    explain: $("explain").checked,
    mode: $("mode").value,
  };
  if ($("syntax").checked) body.syntax = "simple";
  for (const name of ["nprobe", "rerank_count"]) {
    const value = optionalInt(name);
    if (value !== null) body[name] = value;
  }
  const filter = $("filter").value.trim();
  if (filter !== "") {
    try {
      body.filter = JSON.parse(filter);
    } catch (err) {
      throw new Error(`filter is not valid JSON: ${err.message}`);
    }
  }
  return body;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function search(body) {
  showError("");
  $("search-button").disabled = true;
  $("status").textContent = "searching…";
  const headers = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const response = await fetch("/v1/search", { method: "POST", headers, body: JSON.stringify(body) });
    const payload = await response.json().catch(() => ({}));
    if (response.status === 401) {
      if (key) sessionStorage.removeItem(KEY_STORAGE);
      pending = body;
      $("key-form").hidden = false;
      $("api-key").focus();
      showError(key ? "That API key was refused; try again." : "");
      $("status").textContent = "API key needed";
      return;
    }
    if (!response.ok) {
      showError(`${response.status}: ${payload.message || response.statusText}`);
      $("status").textContent = "";
      return;
    }
    render(payload, body.query);
    const ignored = payload.stats && payload.stats.ignored ? ` (read as text: ${payload.stats.ignored.join("; ")})` : "";
    $("status").textContent = `${payload.results.length} results${ignored}`;
  } catch (err) {
    showError(`request failed: ${err.message}`);
    $("status").textContent = "";
  } finally {
    $("search-button").disabled = false;
  }
}

function formatBytes(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / 1024 / 1024).toFixed(2)} MiB`;
}

function renderStats(stats) {
  const box = $("stats");
  box.replaceChildren();
  const summary = el("div", "summary");
  const facts = [
    ["total", `${stats.stage_ms.total.toFixed(1)} ms`],
    ["hit rate", `${(100 * stats.hit_rate).toFixed(0)}%`],
    ["bytes read", formatBytes(stats.bytes_read)],
    ["reads", `${stats.ios}`],
    ["prefetched / missed", `${stats.prefetched} / ${stats.missed}`],
    ["engine", stats.engine],
  ];
  for (const [name, value] of facts) {
    const fact = el("span", "fact");
    fact.append(el("span", "muted", `${name} `), el("strong", "", value));
    fact.dataset.stat = name;
    summary.append(fact);
  }
  box.append(summary);
  const stages = Object.entries(stats.stage_ms).filter(([name]) => name !== "total");
  const longest = Math.max(...stages.map(([, ms]) => ms), 1e-9);
  const table = el("div", "stages");
  for (const [name, ms] of stages) {
    const row = el("div", "stage");
    row.dataset.stage = name;
    const bar = el("span", "bar");
    bar.style.width = `${(100 * ms) / longest}%`;
    const track = el("span", "track");
    track.append(bar);
    row.append(el("span", "name", name), track, el("span", "ms", `${ms.toFixed(2)} ms`));
    table.append(row);
  }
  box.append(table);
  box.hidden = false;
}

// The explanation's spans of one field -> non-overlapping highlight ranges with a strength
// in [0, 1] (the query token's similarity, scaled between the hit's weakest and strongest
// match) and the tokens that matched.
function rangesOf(explanation, field) {
  const similarities = explanation.matches.map((m) => m.similarity);
  const low = Math.min(...similarities);
  const spread = Math.max(Math.max(...similarities) - low, 1e-9);
  const byRange = new Map();
  for (const match of explanation.matches) {
    for (const span of match.spans) {
      if (span.field !== field || span.end <= span.start) continue;
      const key = `${span.start}:${span.end}`;
      const range = byRange.get(key) || { start: span.start, end: span.end, strength: 0, tokens: [] };
      range.strength = Math.max(range.strength, (match.similarity - low) / spread);
      range.tokens.push(`${match.token} ${match.similarity.toFixed(2)}`);
      byRange.set(key, range);
    }
  }
  const ranges = [...byRange.values()].sort((a, b) => a.start - b.start || b.end - a.end);
  const kept = [];
  for (const range of ranges) {
    if (!kept.length || range.start >= kept[kept.length - 1].end) kept.push(range);
  }
  return kept;
}

// The lexical side's matches of one field -> highlight ranges, strength by BM25 contribution.
function lexicalRangesOf(matches, field) {
  const top = Math.max(...matches.map((m) => m.score), 1e-9);
  const ranges = [];
  for (const match of matches) {
    for (const span of match.spans) {
      if (span.field !== field || span.end <= span.start) continue;
      ranges.push({ start: span.start, end: span.end, strength: match.score / top,
                    tokens: [`${match.terms} (BM25 ${match.score.toFixed(2)})`] });
    }
  }
  ranges.sort((a, b) => a.start - b.start || b.end - a.end);
  const kept = [];
  for (const range of ranges) {
    if (!kept.length || range.start >= kept[kept.length - 1].end) kept.push(range);
  }
  return kept;
}

// MaxSim highlights where the hit has them (dense, hybrid); BM25 ones in lexical mode.
function rangesFor(hit, field) {
  if (hit.explanation) return rangesOf(hit.explanation, field);
  if (hit.lexical_matches) return lexicalRangesOf(hit.lexical_matches, field);
  return [];
}

function highlighted(text, ranges, lexical) {
  const fragment = document.createDocumentFragment();
  let at = 0;
  for (const range of ranges) {
    fragment.append(text.slice(at, range.start));
    const mark = el("mark", lexical ? "hl lx" : "hl", text.slice(range.start, range.end));
    const colour = lexical ? "80, 150, 255" : "255, 165, 0";  // BM25 matches blue, MaxSim orange
    mark.style.backgroundColor = `rgba(${colour}, ${(0.12 + 0.78 * range.strength).toFixed(2)})`;
    mark.dataset.strength = range.strength.toFixed(3);
    mark.title = `matched by: ${range.tokens.join(", ")}`;
    fragment.append(mark);
    at = range.end;
  }
  fragment.append(text.slice(at));
  return fragment;
}

function matchedText(hit, match) {
  if (match.row !== undefined && match.row !== null) return `patch ${match.row + 1}, ${match.column + 1}`;
  const span = match.spans.find((s) => s.field !== "joiner");
  if (!span) return "—";
  const source = span.field === "title" ? hit.title : hit.text;
  return source.slice(span.start, span.end);
}

// The words of a lexical match as the user typed them ("eclipse", not the stem "eclips"):
// query_start and query_end count code points, as the server's Python strings do.
function typedWords(query, match) {
  const written = Array.from(query).slice(match.query_start, match.query_end).join("");
  return written.replace(/^[+-]/, "").replace(/^"(.*)"$/, "$1") || match.terms;
}

// Pages (an index of page images): each hit's thumbnail, fetched with the API key like the search,
// and, with explanations, a heatmap of the patches its query tokens matched (cell (row, column)
// of the page cut into the explanation's grid, strength the best similarity there, scaled
// between the hit's weakest and strongest match). A text index answers the first thumbnail
// with a 404, after which none is asked for.
const THUMBNAIL_SIDE = 256;
let pagesIndex = null; // null: not known yet; false: a text index

function heatmap(canvas, explanation, width, height) {
  const [rows, columns] = explanation.grid;
  const placed = explanation.matches.filter((m) => m.row !== null && m.row !== undefined);
  if (!placed.length) return;
  const similarities = placed.map((m) => m.similarity);
  const low = Math.min(...similarities);
  const spread = Math.max(Math.max(...similarities) - low, 1e-9);
  const cells = new Map();
  for (const match of placed) {
    const key = match.row * columns + match.column;
    cells.set(key, Math.max(cells.get(key) ?? 0, 0.15 + (0.85 * (match.similarity - low)) / spread));
  }
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext("2d");
  for (const [key, strength] of cells) {
    const row = Math.floor(key / columns);
    const column = key % columns;
    context.fillStyle = `rgba(255, 165, 0, ${(0.6 * strength).toFixed(3)})`;
    context.fillRect((column * width) / columns, (row * height) / rows, width / columns, height / rows);
  }
}

async function loadThumbnail(hit, figure) {
  if (pagesIndex === false) return;
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  const url = `/v1/documents/${encodeURIComponent(hit.id)}?image=true&max_side=${THUMBNAIL_SIDE}`;
  const response = await fetch(url, { headers }).catch(() => null);
  if (!response || !response.ok) {
    if (response && response.status === 404 && pagesIndex === null) pagesIndex = false;
    return;
  }
  pagesIndex = true;
  const image = el("img", "thumbnail");
  image.alt = `page ${hit.id}`;
  image.src = URL.createObjectURL(await response.blob());
  image.addEventListener("load", () => {
    URL.revokeObjectURL(image.src);
    if (hit.explanation && hit.explanation.grid) {
      heatmap(canvas, hit.explanation, image.naturalWidth, image.naturalHeight);
    }
  });
  const canvas = el("canvas", "heatmap");
  figure.replaceChildren(image, canvas);
  figure.hidden = false;
}

function renderHit(hit, rank, query) {
  const item = el("li", "result");
  item.dataset.id = hit.id;
  const head = el("div", "head");
  head.append(el("span", "rank", `${rank}.`));
  const title = el("span", "title");
  const lexical = !hit.explanation;
  title.append(highlighted(hit.title || "", rangesFor(hit, "title"), lexical));
  head.append(title, el("span", "doc-id muted", hit.id));
  item.append(head);

  const scores = el("div", "scores muted");
  scores.append(el("span", "", `score ${hit.score.toFixed(4)}`));
  if ("dense_score" in hit) {  // hybrid: the fused score and both sides'
    const side = (value, name) => (value === null ? `${name} —` : `${name} ${value.toFixed(4)}`);
    scores.append(el("span", "fused", `fused from ${side(hit.dense_score, "dense")}, ${side(hit.lexical_score, "BM25")}`));
  }
  if (hit.cls_score === null) {
    scores.append(el("span", "", hit.lexical_score === null ? "" : `BM25 ${hit.lexical_score.toFixed(4)}`));
  } else if (hit.explanation) {
    const e = hit.explanation;
    scores.append(el("span", "", `= CLS ${e.cls_part.toFixed(4)} (w ${e.weight.toFixed(2)} × ${hit.cls_score.toFixed(4)})`),
      el("span", "", `+ BOW ${e.bow_part.toFixed(4)} ((1 − w) × ${hit.bow_score.toFixed(4)})`));
  } else {
    scores.append(el("span", "", `CLS ${hit.cls_score.toFixed(4)}`),
      el("span", "", hit.bow_score === null ? "not re-ranked" : `BOW ${hit.bow_score.toFixed(4)}`));
  }
  item.append(scores);

  const text = el("p", "text");
  text.append(highlighted(hit.text || "", rangesFor(hit, "text"), lexical));
  item.append(text);

  const figure = el("figure", "page");  // filled by loadThumbnail on an index of pages
  figure.hidden = true;
  item.append(figure);
  loadThumbnail(hit, figure);

  if (hit.lexical_matches && hit.lexical_matches.length) {
    const matches = el("div", "matches lexical");
    const top = Math.max(...hit.lexical_matches.map((m) => m.score), 1e-9);
    for (const match of hit.lexical_matches) {
      const chip = el("span", "match lexical");
      chip.title = `BM25 contribution ${match.score.toFixed(4)} (indexed as: ${match.terms})`;
      const bar = el("span", "strength");
      bar.style.width = `${Math.max(0, (100 * match.score) / top)}%`;
      chip.append(el("span", "q", typedWords(query, match)), el("span", "arrow", "BM25"), el("span", "d", match.score.toFixed(2)), bar);
      matches.append(chip);
    }
    item.append(matches);
  }

  if (hit.explanation) {
    const matches = el("div", "matches");
    const total = Math.max(...hit.explanation.matches.map((m) => m.contribution), 1e-9);
    for (const match of hit.explanation.matches) {
      const chip = el("span", "match");
      chip.title = `similarity ${match.similarity.toFixed(3)}, contribution ${match.contribution.toFixed(4)}`;
      const bar = el("span", "strength");
      bar.style.width = `${Math.max(0, (100 * match.contribution) / total)}%`;
      chip.append(el("span", "q", match.token), el("span", "arrow", "→"), el("span", "d", matchedText(hit, match)), bar);
      matches.append(chip);
    }
    item.append(matches);
  }
  return item;
}

function render(payload, query) {
  renderStats(payload.stats);
  const list = $("results");
  list.replaceChildren(...payload.results.map((hit, i) => renderHit(hit, i + 1, query)));
  if (!payload.results.length) list.append(el("li", "muted", "No results."));
}

$("explain").checked = localStorage.getItem(EXPLAIN_STORAGE) === "on";
$("explain").addEventListener("change", () => {
  localStorage.setItem(EXPLAIN_STORAGE, $("explain").checked ? "on" : "off");
});

$("search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  let body;
  try {
    body = requestBody();
  } catch (err) {
    showError(err.message);
    return;
  }
  syncUrl(body);
  search(body);
});

// The URL carries the search (`?q=...&k=...&mode=...`), so a search can be linked, bookmarked
// and reloaded; opening such a link runs it.
const URL_FIELDS = { q: "query", k: "k", mode: "mode" };

function syncUrl(body) {
  const params = new URLSearchParams();
  params.set("q", body.query);
  if (body.k !== 10) params.set("k", String(body.k));
  if (body.mode && body.mode !== "dense") params.set("mode", body.mode);
  history.replaceState(null, "", `${location.pathname}?${params}`);
}

function searchFromUrl() {
  const params = new URLSearchParams(location.search);
  if (!params.get("q")) return;
  for (const [param, id] of Object.entries(URL_FIELDS)) {
    const value = params.get(param);
    if (value === null) continue;
    if (id === "mode" && ![...$("mode").options].some((option) => option.value === value)) continue;
    $(id).value = value;
  }
  $("search-form").requestSubmit();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("api-key").value);
  $("api-key").value = "";
  $("key-form").hidden = true;
  if (pending) {
    const body = pending;
    pending = null;
    search(body);
  }
});

searchFromUrl();
