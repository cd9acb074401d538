// A Markdown subset rendered to DOM nodes. Model text only ever enters the page through createTextNode, so HTML in
// an answer is shown as text and never parsed: safe by construction, no sanitizer needed.
// Every text node knows where it stands in the source, so the characters of accepted drafts can be marked.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+/;
const PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

// The source cut into lines, each with its offsets (end excludes the newline).
function linesOf(source) {
  const lines = [];
  let start = 0;
  for (const text of source.split("\n")) {
    lines.push({ text, start, end: start + text.length });
    start += text.length + 1;
  }
  return lines;
}

class Renderer {
  constructor(source, draftSpans) {
    this.source = source;
    this.drafted = new Uint8Array(source.length);
    for (const [start, end] of draftSpans) this.drafted.fill(1, start, Math.min(end, source.length));
  }

  // source[start, end) as text nodes, drafted runs wrapped in <span class="draft">; `kind`: a highlight class.
  text(parent, start, end, kind) {
    if (start >= end) return;
    const target = kind ? parent.appendChild(element("span", "tok-" + kind)) : parent;
    let run = start;
    for (let i = start + 1; i <= end; i++) {
      if (i < end && this.drafted[i] === this.drafted[run]) continue;
      const node = document.createTextNode(this.source.slice(run, i));
      if (this.drafted[run]) target.appendChild(element("span", "draft")).appendChild(node);
      else target.appendChild(node);
      run = i;
    }
  }

  blocks(parent, lines) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.text.trim()) i += 1;
      else if (FENCE.test(line.text)) i = this.code(parent, lines, i);
      else if (HEADING.test(line.text)) i = this.heading(parent, line, i);
      else if (RULE.test(line.text)) (parent.appendChild(element("hr")), (i += 1));
      else if (QUOTE.test(line.text)) i = this.quote(parent, lines, i);
      else if (ITEM.test(line.text)) i = this.list(parent, lines, i, ITEM.exec(line.text)[1].length);
      else i = this.paragraph(parent, lines, i);
    }
  }

  code(parent, lines, i) {
    const [, fence, language] = FENCE.exec(lines[i].text);
    let last = i + 1;
    const closes = (text) => text.trim().startsWith(fence) && /^([`~])\1*$/.test(text.trim());
    while (last < lines.length && !closes(lines[last].text)) last += 1;
    const start = i + 1 < lines.length ? lines[i + 1].start : lines[i].end;
    const end = Math.max(start, last < lines.length ? lines[last].start - 1 : this.source.length);
    parent.appendChild(this.codeBlock(language, start, end));
    return last + 1;
  }

  codeBlock(language, start, end) {
    const box = element("div", "code-block");
    const head = box.appendChild(element("div", "code-head"));
    head.appendChild(element("span", "code-language")).textContent = language || "text";
    const copy = head.appendChild(element("button", "copy"));
    copy.type = "button";
    copy.textContent = "Copy";
    copy.dataset.code = this.source.slice(start, end);
    const code = box.appendChild(element("pre")).appendChild(element("code"));
    if (language) code.dataset.language = language;
    for (const [from, to, kind] of highlight(this.source, start, end, language)) this.text(code, from, to, kind);
    return box;
  }

  heading(parent, line, i) {
    const [marker, hashes] = HEADING.exec(line.text);
    this.inline(parent.appendChild(element("h" + hashes.length)), line.start + marker.length, line.end);
    return i + 1;
  }

  quote(parent, lines, i) {
    const box = parent.appendChild(element("blockquote"));
    for (; i < lines.length && QUOTE.test(lines[i].text); i++) {
      if (box.firstChild) box.appendChild(document.createTextNode("\n"));
      this.inline(box, lines[i].start + QUOTE.exec(lines[i].text)[0].length, lines[i].end);
    }
    return i;
  }

  // Items at `indent`; deeper items nest in the item above them, other indented lines continue it.
  list(parent, lines, i, indent) {
    const ordered = /\d/.test(ITEM.exec(lines[i].text)[2]);
    const box = parent.appendChild(element(ordered ? "ol" : "ul"));
    if (ordered) box.start = parseInt(ITEM.exec(lines[i].text)[2], 10);
    let item = null;
    while (i < lines.length && lines[i].text.trim()) {
      const line = lines[i];
      const match = ITEM.exec(line.text);
      const depth = line.text.length - line.text.trimStart().length;
      if (match && match[1].length === indent && /\d/.test(match[2]) === ordered) {
        item = box.appendChild(element("li"));
        this.inline(item, line.start + match[0].length, line.end);
        i += 1;
      } else if (match && depth > indent && item) i = this.list(item, lines, i, match[1].length);
      else if (depth > indent && item) {
        item.appendChild(document.createTextNode("\n"));
        this.inline(item, line.start + depth, line.end);
        i += 1;
      } else break;
    }
    return i;
  }

  paragraph(parent, lines, i) {
    let last = i;
    const startsBlock = (text) => [FENCE, HEADING, RULE, QUOTE, ITEM].some((pattern) => pattern.test(text));
    while (last + 1 < lines.length && lines[last + 1].text.trim() && !startsBlock(lines[last + 1].text)) last += 1;
    this.inline(parent.appendChild(element("p")), lines[i].start, lines[last].end);
    return last + 1;
  }

  // Code spans, **strong**, *emphasis*, ~~strikethrough~~, [links](http://...) and backslash escapes.
  inline(parent, start, end) {
    const s = this.source;
    let plain = start;
    const flush = (to) => (this.text(parent, plain, to), to);
    for (let i = start; i < end; ) {
      const span = this.inlineSpan(parent, i, end, flush);
      if (span > i) (plain = span), (i = span);
      else if (s[i] === "\\" && i + 1 < end && PUNCTUATION.includes(s[i + 1])) {
        flush(i);
        this.text(parent, i + 1, i + 2);
        plain = i = i + 2;
      } else i += 1;
    }
    flush(end);
  }

  // The inline element at i, if one starts there (after flushing the plain text before it): where it ends, else i.
  inlineSpan(parent, i, end, flush) {
    const s = this.source;
    if (s[i] === "`") {
      const ticks = /^`+/.exec(s.slice(i, end))[0];
      const close = s.indexOf(ticks, i + ticks.length);
      if (close < 0 || close >= end) return i;
      flush(i);
      const code = parent.appendChild(element("code"));
      const padded = s[i + ticks.length] === " " && s[close - 1] === " " && close - i - ticks.length > 2;
      this.text(code, i + ticks.length + padded, close - padded);
      return close + ticks.length;
    }
    for (const [marker, tag] of [["**", "strong"], ["__", "strong"], ["~~", "del"], ["*", "em"], ["_", "em"]]) {
      if (!s.startsWith(marker, i)) continue;
      const close = this.closing(marker, i, end);
      if (close < 0) continue;
      flush(i);
      this.inline(parent.appendChild(element(tag)), i + marker.length, close);
      return close + marker.length;
    }
    if (s[i] === "[") return this.link(parent, i, end, flush);
    return i;
  }

  // Where `marker` opened at i closes before end (-1: it does not); no space just inside, `_` only between words.
  closing(marker, i, end) {
    const s = this.source;
    const open = i + marker.length;
    if (open >= end || /\s/.test(s[open]) || (marker[0] === "_" && /\w/.test(s[i - 1] || ""))) return -1;
    for (let close = s.indexOf(marker, open + 1); close >= 0 && close + marker.length <= end; close = s.indexOf(marker, close + 1)) {
      const wordAfter = marker[0] === "_" && /\w/.test(s[close + marker.length] || "");
      const doubled = marker.length === 1 && s[close + 1] === marker;
      if (!/\s/.test(s[close - 1]) && !wordAfter && !doubled) return close;
      if (doubled) close += 1;
    }
    return -1;
  }

  link(parent, i, end, flush) {
    const s = this.source;
    const middle = s.indexOf("](", i);
    const close = middle < 0 ? -1 : s.indexOf(")", middle);
    if (close < 0 || close >= end || s.slice(i, middle).includes("\n")) return i;
    const href = safeHref(s.slice(middle + 2, close).trim());
    if (!href) return i;  // a javascript: or data: link stays text
    flush(i);
    const anchor = parent.appendChild(element("a"));
    anchor.href = href;
    anchor.rel = "noopener noreferrer nofollow";
    anchor.target = "_blank";
    this.inline(anchor, i + 1, middle);
    return close + 1;
  }
}

function safeHref(text) {
  try {
    const url = new URL(text);
    return LINK_PROTOCOLS.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

export function element(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

// The rendered Markdown of `source`, with source offsets [start, end) in `draftSpans` marked as drafted.
export function renderMarkdown(source, draftSpans = []) {
  const fragment = document.createDocumentFragment();
  const renderer = new Renderer(source, draftSpans);
  renderer.blocks(fragment, linesOf(source));
  return fragment;
}

// --- highlighting: a few token kinds per language family, enough to read code at a glance ---

const C_LIKE = "auto break case catch class const continue default delete do else enum export extends false final finally for fn func function go if impl import in instanceof interface let match mod mut new nil null package private protected pub public return self static struct super switch this throw throws true try type typeof use var void while yield async await";
const FAMILIES = {
  python: { comment: "#", keywords: "and as assert async await break class continue def del elif else except False finally for from global if import in is lambda None nonlocal not or pass raise return self True try while with yield" },
  shell: { comment: "#", keywords: "case do done echo elif else esac exit export fi for function if in local return set then until while" },
  c: { comment: "//", block: true, keywords: C_LIKE + " bool char double float int long short signed sizeof unsigned include define" },
  sql: { comment: "--", keywords: "select from where and or not insert into values update set delete create table drop alter join left right inner outer on group by order having limit as null is in like distinct union" },
  data: { comment: "#", keywords: "true false null yes no" },
};
const LANGUAGES = {
  py: "python", python: "python", sh: "shell", bash: "shell", shell: "shell", zsh: "shell", console: "shell",
  js: "c", javascript: "c", ts: "c", typescript: "c", jsx: "c", tsx: "c", java: "c", c: "c", cpp: "c", "c++": "c",
  h: "c", cs: "c", go: "c", rust: "c", rs: "c", swift: "c", kotlin: "c", php: "c", json: "data", sql: "sql",
  yaml: "data", yml: "data", toml: "data", ruby: "python", rb: "python", r: "python",
};
const SLASH_COMMENT = /\/\*[\s\S]*?(?:\*\/|$)|\/\/[^\n]*/.source;
const PYTHON_STRING = /"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?/.source;
const STRING = /"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|`(?:[^`\\]|\\.)*`?/.source;  // an unclosed one runs to the line's end
const NUMBER = /\b(?:0[xX][0-9a-fA-F]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b/.source;
const patterns = new Map();

function patternFor(family) {
  if (patterns.has(family)) return patterns.get(family);
  const spec = FAMILIES[family];
  const parts = [
    `(?<comment>${spec.block ? SLASH_COMMENT : escapeRegExp(spec.comment) + "[^\\n]*"})`,
    `(?<string>${family === "python" ? PYTHON_STRING : STRING})`,
    `(?<number>${NUMBER})`,
    `(?<keyword>\\b(?:${spec.keywords.split(" ").join("|")})\\b)`,
  ];
  const pattern = new RegExp(parts.join("|"), family === "sql" ? "gi" : "g");
  patterns.set(family, pattern);
  return pattern;
}

function escapeRegExp(text) {
  return text.replace(/[.*+?^${}()|[\]\\/]/g, "\\$&");
}

// [start, end, kind] runs covering source[start, end); kind is null for plain text.
export function highlight(source, start, end, language) {
  const family = LANGUAGES[(language || "").toLowerCase()];
  if (!family) return [[start, end, null]];  // prose in a fence: an apostrophe is no string
  const pattern = patternFor(family);
  const text = source.slice(start, end);
  const runs = [];
  let plain = 0;
  pattern.lastIndex = 0;
  for (let match; (match = pattern.exec(text)); ) {
    if (!match[0]) {
      pattern.lastIndex += 1;
      continue;
    }
    const kind = Object.keys(match.groups).find((name) => match.groups[name] !== undefined);
    if (match.index > plain) runs.push([start + plain, start + match.index, null]);
    runs.push([start + match.index, start + match.index + match[0].length, kind]);
    plain = match.index + match[0].length;
  }
  if (plain < text.length) runs.push([start + plain, end, null]);
  return runs;
}
