// Web chat for powerinfer-cpp: streams /v1/chat/completions (SSE), renders replies as
// Markdown (markdown.js, DOM only), shows each reply's speed and FFN density from the final
// chunk's "timings", keeps the conversation across reloads (localStorage), and leaves out
// the oldest turns when the conversation outgrows the model's context. No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "pi-chat";
// The conversation: OpenAI-style messages, each with the tokens it took in the prompt
// (`n`, from the server's counts once known) and whether it is left out of the prompt
// (`out`: older turns dropped to fit the context; still shown, greyed).
let chat = [];
let nCtx = 0;                // the server's context (tokens), from /v1/models
let controller = null;       // aborts the reply in flight (the server frees its slot)
const divOf = new Map();     // message -> its element on the page

for (const id of ["system", "max-tokens", "temperature", "api-key"]) {
  const saved = localStorage.getItem("pi-" + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("pi-" + id, $(id).value));
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(chat.map(({ role, content, n, out }) => ({ role, content, n, out }))));
  } catch (e) { /* quota: keep going */ }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text, out) {
  const div = document.createElement("div");
  div.className = "msg " + role + (out ? " out" : "");
  const body = document.createElement("div");
  body.className = "text";
  if (role === "assistant") renderMarkdown(text, body); else body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function notice(text) {
  const div = document.createElement("div");
  div.className = "notice";
  div.textContent = text;
  $("messages").appendChild(div);
  return div;
}

function showStats(div, t, nTokens, seconds) {
  const s = document.createElement("span");
  s.className = "stats";
  const tps = t && t.predicted_per_second ? t.predicted_per_second : nTokens / Math.max(seconds, 1e-3);
  let line = `${nTokens} tokens · ${tps.toFixed(1)} tokens/s`;
  if (t && t.ffn_density !== null && t.ffn_density !== undefined)
    line += ` · FFN density ${(100 * t.ffn_density).toFixed(1)}%`;
  else if (t && t.ffn_mode) line += ` · FFN ${t.ffn_mode}`;
  if (t && t.cached_n) line += ` · ${t.cached_n} of ${t.prompt_n} prompt tokens cached`;
  s.textContent = line;
  div.appendChild(s);
}

// Token estimate of a message not yet counted by the server (~3 characters per token in
// English BPE vocabularies, and the template's few tokens around it): only for deciding
// ahead what to leave out; the server's own count decides in the end.
const estimate = (m) => (m.n !== undefined ? m.n : Math.ceil(m.content.length / 3) + 8);

// Leaves out the oldest kept user/assistant pair while the kept messages, the system
// prompt and room for the reply exceed the context. Returns how many it left out.
function fitContext(system, maxTokens) {
  if (!nCtx) return 0;
  const room = Math.min(maxTokens, Math.floor(nCtx / 4));
  let dropped = 0;
  const used = () => chat.filter((m) => !m.out).reduce((s, m) => s + estimate(m), 0) +
                     (system ? Math.ceil(system.length / 3) + 8 : 0) + room;
  while (used() > nCtx && dropOldest()) dropped++;
  return dropped;
}

// Marks the oldest kept pair (or lone message) as left out; false if only the newest
// user message is left.
function dropOldest() {
  const kept = chat.filter((m) => !m.out);
  if (kept.length <= 1) return false;
  kept[0].out = true;
  if (kept.length > 2 && kept[1].role === "assistant") kept[1].out = true;
  return true;
}

function markOut() {
  for (const m of chat) if (m.out && divOf.has(m)) divOf.get(m).classList.add("out");
}

async function request(system, maxTokens) {
  const messages = [];
  if (system) messages.push({ role: "system", content: system });
  for (const m of chat) if (!m.out) messages.push({ role: m.role, content: m.content });
  return fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), signal: controller.signal,
    body: JSON.stringify({
      messages, stream: true, max_tokens: maxTokens,
      temperature: parseFloat($("temperature").value) || 0,
    }),
  });
}

async function send(text) {
  const system = $("system").value.trim();
  const maxTokens = parseInt($("max-tokens").value, 10) || 64;
  const user = { role: "user", content: text };
  const outBefore = chat.map((m) => m.out);
  chat.push(user);
  const userDiv = addMessage("user", text);
  divOf.set(user, userDiv);
  let dropped = fitContext(system, maxTokens);
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").hidden = false;
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  const t0 = performance.now();
  let reply = "", nTokens = 0, timings = null;
  try {
    let resp;
    for (;;) {
      resp = await request(system, maxTokens);
      if (resp.ok) break;
      const err = await resp.json().catch(() => ({}));
      const e = err.error || {};
      // the server counted more than estimated: leave out one more turn and retry
      if (e.code === "context_length_exceeded" && dropOldest()) { dropped++; continue; }
      throw new Error(e.message || resp.statusText);
    }
    if (dropped) {
      markOut();
      const n = chat.filter((m) => m.out).length;
      $("messages").insertBefore(notice(
        `The ${n} oldest message(s) are left out of the prompt to fit the model's ` +
        `${nCtx}-token context (greyed above).`), userDiv);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {       // one SSE event per blank line
        const event = buf.slice(0, end);
        buf = buf.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.timings) timings = chunk.timings;
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && choice.delta.content) {
            reply += choice.delta.content;
            nTokens += 1;
            div.dataset.chunks = nTokens;   // streamed chunks so far (tests read it)
            renderMarkdown(reply, out);
            $("messages").scrollTop = $("messages").scrollHeight;
          }
        }
      }
    }
    divOf.set(finish(user, reply, timings, system), div);
    div.dataset.done = "1";
    showStats(div, timings, timings ? timings.predicted_n : nTokens, (performance.now() - t0) / 1e3);
  } catch (e) {
    if (e.name === "AbortError") {
      divOf.set(finish(user, reply, null, system), div);
      div.dataset.done = "1";
      showStats(div, null, nTokens, (performance.now() - t0) / 1e3);
    } else {
      chat.pop();                                     // the message did not go through:
      outBefore.forEach((o, i) => { chat[i].out = o; });  // nothing was left out for it
      userDiv.classList.add("out");
      div.className = "msg error";
      out.textContent = "error: " + e.message;
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").hidden = true;
    save();
  }
}

// Records the reply, and the server's token counts: the prompt it read (every kept
// message, the system prompt and the template) less what the rest is known or estimated
// to take is the new user message's share. Returns the reply's message.
function finish(user, reply, t, system) {
  const asst = { role: "assistant", content: reply };
  if (t) {
    const before = chat.filter((m) => !m.out && m !== user).reduce((s, m) => s + estimate(m), 0) +
                   (system ? Math.ceil(system.length / 3) + 8 : 0);
    user.n = Math.max(1, t.prompt_n - before);
    asst.n = t.predicted_n + 2;   // and its end-of-turn tokens
  }
  chat.push(asst);
  return asst;
}

function newChat() {
  if (controller) controller.abort();
  chat = [];
  divOf.clear();
  $("messages").textContent = "";
  save();
}

function restore() {
  try { chat = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { chat = []; }
  if (!Array.isArray(chat)) chat = [];
  chat = chat.filter((m) => m && (m.role === "user" || m.role === "assistant") &&
                            typeof m.content === "string");
  for (const m of chat) {
    const div = addMessage(m.role, m.content, m.out);
    if (m.role === "assistant") div.dataset.done = "1";
    divOf.set(m, div);
  }
  if (chat.some((m) => m.out)) {
    const first = [...$("messages").querySelectorAll(".msg")].find((d) => !d.classList.contains("out"));
    $("messages").insertBefore(notice("The greyed messages are left out of the prompt " +
                                      "(the model's context is full)."), first || null);
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", newChat);

restore();
fetch("/v1/models", { headers: headers() }).then((r) => r.json()).then((m) => {
  const d = m.data && m.data[0];
  if (!d) return;
  nCtx = d.meta.n_ctx;
  let line = `${d.id} · context ${d.meta.n_ctx} tokens`;
  if (d.meta.ffn_mode) line += ` · FFN ${d.meta.ffn_mode}`;
  $("model-name").textContent = line;
}).catch(() => {});
fetch("/health").then((r) => r.json()).then((h) => {
  $("status").textContent = `server ok · ${h.slots_idle + h.slots_processing} slot(s)`;
}).catch(() => { $("status").textContent = "server unreachable"; });
