// akunu's chat page: conversations kept in this browser, answers streamed from /v1/chat/completions with the
// tokens of accepted drafts marked (the server's `akunu.drafted` extension) and live speed per answer.

import { listModels, ServerError, streamChat } from "./api.js";
import { element, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const state = {
  conversations: store.loadConversations(),
  current: store.newConversation(),
  settings: store.loadSettings(),
  models: [], // [{id, state}] as /v1/models lists them
  streaming: null, // {controller, conversation, message, view, live}
};

// --- conversations ---

function save() {
  const { current, conversations } = state;
  if (!conversations.includes(current) && current.messages.some((m) => m.role === "user")) conversations.unshift(current);
  store.saveConversations(conversations);
  renderSidebar();
}

function open(conversation) {
  if (state.streaming) stop();
  state.current = conversation;
  document.body.classList.remove("show-sidebar");
  renderConversation();
  $("prompt").focus();
}

function remove(conversation) {
  state.conversations = state.conversations.filter((c) => c !== conversation);
  store.saveConversations(state.conversations);
  if (state.current === conversation) open(store.newConversation());
  else renderSidebar();
}

function addError(text, conversation = state.current) {
  conversation.messages.push({ role: "error", content: text });
  save();
  if (conversation === state.current) renderConversation();
}

// --- sending and streaming ---

function send(text) {
  if (state.streaming || !text.trim()) return;
  const conversation = state.current;
  conversation.messages.push({ role: "user", content: text });
  conversation.title ||= text.trim().split("\n")[0].slice(0, 60);
  conversation.updated = Date.now();
  save();
  answer(conversation);
}

function requestBody(conversation) {
  const { system, temperature, topP, maxTokens, speculative, model } = state.settings;
  const history = conversation.messages.filter((m) => m.role === "user" || m.role === "assistant");
  const messages = history.map(({ role, content }) => ({ role, content }));
  const body = {
    messages: system.trim() ? [{ role: "system", content: system }, ...messages] : messages,
    temperature: Number(temperature) || 0,
    top_p: topP === "" ? 1 : Number(topP),
    speculative, // akunu's extension: false decodes without drafts
  };
  if (model) body.model = model;
  if (Number(maxTokens) > 0) body.max_tokens = Number(maxTokens);
  return body;
}

async function answer(conversation) {
  const body = requestBody(conversation);
  const message = { role: "assistant", content: "", drafted: [], stats: null };
  conversation.messages.push(message);
  const streaming = { controller: new AbortController(), conversation, message, pending: null };
  streaming.live = { firstAt: null, tokens: 0, accepted: 0 };
  state.streaming = streaming;
  renderConversation();
  streaming.view = $("messages").lastElementChild;
  showStreaming(true);
  if (state.models.find((model) => model.id === body.model)?.state !== "loaded") setTimeout(loadModels, 300);
  let failure = null;
  try {
    for await (const event of streamChat(body, { key: store.apiKey.get(), signal: streaming.controller.signal })) {
      if (event.done) message.stats = serverStats(event);
      else addPiece(streaming, event);
    }
  } catch (error) {
    if (error.name === "AbortError") message.stats = { ...liveStats(streaming.live), note: "stopped" };
    else failure = error;
  }
  finish(streaming, failure);
}

function addPiece(streaming, { text, drafted }) {
  const { message, live } = streaming;
  if (drafted) {
    const last = message.drafted[message.drafted.length - 1];
    if (last && last[1] === message.content.length) last[1] += text.length;
    else message.drafted.push([message.content.length, message.content.length + text.length]);
  }
  message.content += text;
  live.firstAt ??= performance.now();
  live.tokens += 1;
  live.accepted += drafted ? 1 : 0;
  message.stats = liveStats(live);
  scheduleRender(streaming);
}

function finish(streaming, failure) {
  const { conversation, message } = streaming;
  if (streaming.pending) cancelAnimationFrame(streaming.pending);
  state.streaming = null;
  showStreaming(false);
  if (failure && !message.content) conversation.messages.splice(conversation.messages.indexOf(message), 1);
  else if (!message.stats?.final && !message.stats?.note) message.stats = { ...liveStats(streaming.live), note: "incomplete" };
  conversation.updated = Date.now();
  if (failure) addError(describe(failure), conversation);
  else save();
  if (conversation === state.current) renderConversation();
  if (failure instanceof ServerError && failure.status === 401) askForKey(describe(failure));
}

function stop() {
  state.streaming?.controller.abort();
}

// --- statistics: estimates while streaming (each pass yields one token that was not drafted), the server's at the end ---

function liveStats(live) {
  const seconds = live.firstAt ? (performance.now() - live.firstAt) / 1000 : 0;
  const passes = Math.max(1, live.tokens - live.accepted);
  const tps = seconds > 0 ? (live.tokens - 1) / seconds : null;
  return { tokens: live.tokens, tps, tokensPerPass: live.tokens / passes, accepted: live.accepted, drafted: null };
}

function serverStats({ stats, usage, finish }) {
  const note = finish === "length" ? "max tokens reached" : null;
  const { decode_tps: tps, tokens_per_pass: tokensPerPass, accepted, drafted } = stats;
  return { tokens: usage.completion_tokens, tps, tokensPerPass, accepted, drafted, note, final: true };
}

function statsText(stats) {
  const parts = [`${stats.tokens} tokens`];
  if (stats.tps) parts.push(`${stats.tps.toFixed(1)} tok/s`);
  if (stats.tokensPerPass) parts.push(`${stats.tokensPerPass.toFixed(2)} tokens/pass`);
  if (stats.drafted === 0) parts.push("no drafts");
  else if (stats.drafted) parts.push(`${stats.accepted} of ${stats.drafted} drafted tokens accepted`);
  else parts.push(`${stats.accepted} drafted tokens accepted`);
  if (stats.note) parts.push(stats.note);
  return parts.join(" · ");
}

// --- errors ---

function describe(error) {
  if (!(error instanceof ServerError)) return `The page failed: ${error.message}`;
  const said = error.message;
  if (error.status === 0) return `The server did not answer: is akunu serve still running? (${said})`;
  if (error.status === 401) return `401 · The server refused the API key: ${said}`;
  if (error.status === 413) return `413 · The message is too large for the server: ${said}`;
  if (error.status === 429) return `429 · The server is busy${error.retryAfter ? `; retry in ${error.retryAfter} s` : ""}: ${said}`;
  if (error.code === "context_length_exceeded") {
    return `The conversation no longer fits in the model's context: start a new conversation or edit the last message. (${said})`;
  }
  return `${error.status} · ${said}`;
}

// --- rendering ---

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = list.appendChild(element("li"));
    const openButton = item.appendChild(element("button", "open"));
    openButton.type = "button";
    openButton.textContent = conversation.title || "Untitled";
    if (conversation === state.current) openButton.setAttribute("aria-current", "true");
    openButton.addEventListener("click", () => open(conversation));
    const deleteButton = item.appendChild(element("button", "delete"));
    deleteButton.type = "button";
    deleteButton.textContent = "×";
    deleteButton.setAttribute("aria-label", `Delete “${openButton.textContent}”`);
    deleteButton.addEventListener("click", () => remove(conversation));
  }
}

function renderConversation() {
  const view = $("messages");
  const { messages } = state.current;
  view.replaceChildren();
  if (!messages.length) view.appendChild(emptyHint());
  const lastUser = messages.map((m) => m.role).lastIndexOf("user");
  messages.forEach((message, index) => view.appendChild(renderMessage(message, index === lastUser && !state.streaming)));
  $("title").textContent = state.current.title || "New conversation";
  renderSidebar();
  view.scrollTop = view.scrollHeight;
}

function emptyHint() {
  const hint = element("div", "empty");
  hint.append("Ask anything. In answers, ");
  hint.appendChild(element("span", "draft")).textContent = "highlighted text";
  hint.append(" came from accepted drafts: several tokens for the price of one pass.");
  return hint;
}

function renderMessage(message, editable) {
  const view = element(message.role === "error" ? "div" : "article", `message ${message.role}`);
  if (message.role === "error") {
    view.setAttribute("role", "alert");
    view.textContent = message.content;
    return view;
  }
  const body = view.appendChild(element("div", "body"));
  if (message.role === "user") {
    body.textContent = message.content;
    if (editable) addEditButton(view, message);
  } else {
    fillAnswer(view, message);
  }
  return view;
}

function fillAnswer(view, message) {
  const body = view.querySelector(".body");
  body.classList.add("markdown");
  body.replaceChildren(renderMarkdown(message.content, message.drafted || []));
  let stats = view.querySelector(".stats");
  if (!stats && message.stats) stats = view.appendChild(element("div", "stats"));
  if (stats) {
    stats.textContent = statsText(message.stats);
    stats.dataset.final = message.stats.final ? "true" : "false";
  }
}

function scheduleRender(streaming) {
  if (streaming.pending) return;
  streaming.pending = requestAnimationFrame(() => {
    streaming.pending = null;
    if (streaming.conversation !== state.current) return;
    const view = $("messages");
    const following = view.scrollHeight - view.scrollTop - view.clientHeight < 80;
    fillAnswer(streaming.view, streaming.message);
    if (following) view.scrollTop = view.scrollHeight;
  });
}

function addEditButton(view, message) {
  const tools = view.appendChild(element("div", "tools"));
  const edit = tools.appendChild(element("button", "edit"));
  edit.type = "button";
  edit.textContent = "Edit";
  edit.addEventListener("click", () => startEdit(view, message));
}

// The last message, edited in place; sending it drops it and everything after it, then asks again.
function startEdit(view, message) {
  const editor = element("textarea", "editor");
  editor.value = message.content;
  editor.rows = Math.min(10, message.content.split("\n").length + 1);
  const resend = element("button", "resend");
  resend.type = "button";
  resend.textContent = "Send";
  const cancel = element("button", "cancel");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const tools = element("div", "tools");
  tools.append(resend, cancel);
  view.replaceChildren(editor, tools);
  const submit = () => {
    if (state.streaming || !editor.value.trim()) return;
    state.current.messages.splice(state.current.messages.indexOf(message));
    send(editor.value);
  };
  resend.addEventListener("click", submit);
  cancel.addEventListener("click", renderConversation);
  editor.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) (event.preventDefault(), submit());
    if (event.key === "Escape") (event.stopPropagation(), renderConversation());
  });
  editor.focus();
}

function showStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("streaming", on);
}

// --- models, settings and the API key ---

async function loadModels() {
  try {
    state.models = await listModels(store.apiKey.get());
  } catch (error) {
    if (state.models.length) return; // a refresh while models load: the next one may answer
    const problem = describe(error);
    if (!(error instanceof ServerError && error.status === 401)) return addError(problem);
    if (store.apiKey.get()) addError(problem);
    askForKey(store.apiKey.get() ? problem : "");
    return;
  }
  const ids = state.models.map((model) => model.id);
  if (!ids.includes(state.settings.model)) state.settings.model = ids[0] || "";
  fillSettings();
  // while a model loads (or the answer waits for one), the picker shows it, refreshed until it is done
  const waiting = state.streaming && !state.streaming.live.firstAt;
  clearTimeout(state.refresh);
  if (waiting || state.models.some((model) => model.state === "loading")) state.refresh = setTimeout(loadModels, 1000);
}

function modelOptions() {
  const label = { loading: " · loading…", unloading: " · unloading", unloaded: " · not loaded" };
  return state.models.map(({ id, state: now }) =>
    Object.assign(element("option"), { value: id, textContent: id + (label[now] || "") }),
  );
}

function askForKey(problem) {
  const shown = $("key-error");
  shown.textContent = problem;
  shown.hidden = !problem;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function fillSettings() {
  const { system, temperature, topP, maxTokens, speculative, model } = state.settings;
  for (const select of [$("setting-model"), $("model-name")]) {
    select.replaceChildren(...modelOptions());
    select.value = model;
  }
  $("setting-system").value = system;
  $("setting-temperature").value = temperature;
  $("setting-top-p").value = topP;
  $("setting-max-tokens").value = maxTokens;
  $("setting-speculative").checked = speculative;
}

function readSettings() {
  state.settings = {
    model: $("setting-model").value,
    system: $("setting-system").value,
    temperature: $("setting-temperature").value,
    topP: $("setting-top-p").value,
    maxTokens: $("setting-max-tokens").value,
    speculative: $("setting-speculative").checked,
  };
  store.saveSettings(state.settings);
  $("model-name").value = state.settings.model;
}

function pickModel() {
  state.settings = { ...state.settings, model: $("model-name").value };
  store.saveSettings(state.settings);
  fillSettings();
  loadModels();
}

// --- wiring ---

function wire() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.streaming || !prompt.value.trim()) return;
    send(prompt.value);
    prompt.value = "";
    fitPrompt();
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) (event.preventDefault(), $("composer").requestSubmit());
  });
  prompt.addEventListener("input", fitPrompt);
  window.addEventListener("resize", fitPrompt);
  document.addEventListener("keydown", (event) => event.key === "Escape" && state.streaming && stop());
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => open(store.newConversation()));
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
  $("open-settings").addEventListener("click", () => (fillSettings(), $("settings").showModal()));
  $("settings-form").addEventListener("input", readSettings);
  $("model-name").addEventListener("change", pickModel);
  $("messages").addEventListener("click", copyCode);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    store.apiKey.set($("key-input").value.trim());
    $("key-input").value = "";
    $("key-dialog").close();
    loadModels();
  });
}

function fitPrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight + 2, 200)}px`;
  prompt.style.overflowY = prompt.scrollHeight > 200 ? "auto" : "hidden";
}

async function copyCode(event) {
  const button = event.target.closest("button.copy");
  if (!button) return;
  try {
    await navigator.clipboard.writeText(button.dataset.code);
  } catch {
    const scratch = document.body.appendChild(Object.assign(element("textarea"), { value: button.dataset.code }));
    scratch.select();
    document.execCommand("copy");
    scratch.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

wire();
fitPrompt();
renderConversation();
loadModels();
