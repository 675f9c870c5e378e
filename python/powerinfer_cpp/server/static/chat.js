// Web chat for powerinfer-cpp: streams /v1/chat/completions (SSE) and shows the
// reply's speed and FFN density from the final chunk's "timings". No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];          // OpenAI-style messages of this conversation
let controller = null;       // aborts the reply in flight (the server frees its slot)

for (const id of ["system", "max-tokens", "temperature", "api-key"]) {
  const saved = localStorage.getItem("pi-" + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("pi-" + id, $(id).value));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
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

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  history.push({ role: "user", content: text });
  messages.push(...history);
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").hidden = false;
  const t0 = performance.now();
  let reply = "", nTokens = 0, timings = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages, stream: true,
        max_tokens: parseInt($("max-tokens").value, 10) || 64,
        temperature: parseFloat($("temperature").value) || 0,
      }),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
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
            out.textContent = reply;
            $("messages").scrollTop = $("messages").scrollHeight;
          }
        }
      }
    }
    history.push({ role: "assistant", content: reply });
    div.dataset.done = "1";
    showStats(div, timings, timings ? timings.predicted_n : nTokens, (performance.now() - t0) / 1e3);
  } catch (e) {
    if (e.name === "AbortError") {
      history.push({ role: "assistant", content: reply });
      div.dataset.done = "1";
      showStats(div, null, nTokens, (performance.now() - t0) / 1e3);
    } else {
      history.pop();
      div.className = "msg error";
      out.textContent = "error: " + e.message;
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").hidden = true;
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
$("clear").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; });

fetch("/v1/models", { headers: headers() }).then((r) => r.json()).then((m) => {
  const d = m.data && m.data[0];
  if (d) $("model-name").textContent = `${d.id} · context ${d.meta.n_ctx} tokens`;
}).catch(() => {});
fetch("/health").then((r) => r.json()).then((h) => {
  $("status").textContent = `server ok · ${h.slots_idle + h.slots_processing} slot(s)`;
}).catch(() => { $("status").textContent = "server unreachable"; });
