// Conversations and settings in the browser's localStorage; the API key in sessionStorage (gone with the tab).

const CONVERSATIONS = "akunu.conversations";
const SETTINGS = "akunu.settings";
const KEY = "akunu.apiKey";

export const DEFAULT_SETTINGS = { system: "", temperature: 0, topP: 1, maxTokens: "", speculative: true, model: "" };

function read(storage, name, fallback) {
  try {
    return JSON.parse(storage.getItem(name)) ?? fallback;
  } catch {
    return fallback;
  }
}

export function loadConversations() {
  const stored = read(localStorage, CONVERSATIONS, []);
  return Array.isArray(stored) ? stored.filter((c) => c && Array.isArray(c.messages)) : [];
}

// Only conversations with a message of the user's are kept; when storage is full the oldest go first.
export function saveConversations(conversations) {
  let kept = conversations.filter((c) => c.messages.some((m) => m.role === "user"));
  kept.sort((a, b) => b.updated - a.updated);
  while (kept.length) {
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(kept));
      return;
    } catch {
      kept = kept.slice(0, -1);
    }
  }
  localStorage.removeItem(CONVERSATIONS);
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(localStorage, SETTINGS, {}) };
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (key) => sessionStorage.setItem(KEY, key),
};

export function newConversation() {
  return { id: crypto.randomUUID?.() ?? String(Date.now() + Math.random()), title: "", updated: Date.now(), messages: [] };
}
