// The page's side of the server: /v1/models and streamed /v1/chat/completions, with the API key in a header only.

export class ServerError extends Error {
  // status 0: no answer from the server at all
  constructor(status, message, { code = null, retryAfter = null } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

function headers(key) {
  const sent = { "Content-Type": "application/json" };
  if (key) sent.Authorization = `Bearer ${key}`;
  return sent;
}

async function request(path, options) {
  let response;
  try {
    response = await fetch(path, options);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ServerError(0, "the server did not answer");
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let message = response.statusText || "request failed";
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message || message;
    code = body.error?.code || null;
  } catch {
    // a proxy's HTML error page: the status says enough
  }
  return new ServerError(response.status, message, { code, retryAfter: response.headers.get("Retry-After") });
}

// [{id, state}], state "loaded", "loading", "unloading" or "unloaded" (another server's models: "loaded")
export async function listModels(key) {
  const response = await request("/v1/models", { headers: headers(key) });
  return (await response.json()).data.map((model) => ({ id: model.id, state: model.state || "loaded" }));
}

// Yields {text, drafted} for each piece of the answer, then {done: true, stats, usage, finish}; throws ServerError.
export async function* streamChat(body, { key, signal }) {
  const response = await request("/v1/chat/completions", {
    method: "POST",
    headers: headers(key),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finish = null;
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ServerError(0, "the connection to the server was lost during the answer");
    }
    if (chunk.done) return;
    buffer += decoder.decode(chunk.value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ServerError(400, parsed.error.message, { code: parsed.error.code });
        const choice = parsed.choices?.[0];
        if (choice?.finish_reason) finish = choice.finish_reason;
        const text = choice?.delta?.content;
        if (text) yield { text, drafted: parsed.akunu?.drafted === true };
        if (parsed.usage && !parsed.choices?.length) yield { done: true, stats: parsed.akunu, usage: parsed.usage, finish };
      }
    }
  }
}
