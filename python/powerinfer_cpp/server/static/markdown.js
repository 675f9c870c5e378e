// A small Markdown renderer for the chat's replies. It builds DOM nodes and sets only
// textContent and vetted attributes, never innerHTML, so a reply cannot inject markup or
// script whatever it contains. Covers what chat models write: fenced code blocks, inline
// code, **bold**, *italic* / _italic_, headings, bullet and numbered lists, block
// quotes, [links](http...) and paragraphs. Anything else shows as the text it is.
"use strict";

const MD_INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|\*([^*\s][^*\n]*?)\*|(^|[^\w])_([^_\s][^_\n]*?)_(?!\w)|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function mdInline(text, parent) {
  let last = 0;
  // matchAll iterates over its own copy of the regex: the calls for **bold** and *em*
  // content below recurse, and a shared lastIndex would send this loop back over them
  for (const m of text.matchAll(MD_INLINE)) {
    let start = m.index;
    if (m[6] !== undefined) start += m[5].length;   // keep the char before _italic_
    if (start > last) parent.appendChild(document.createTextNode(text.slice(last, start)));
    let node;
    if (m[2] !== undefined) {
      node = document.createElement("code");
      node.textContent = m[2];
    } else if (m[3] !== undefined) {
      node = document.createElement("strong");
      mdInline(m[3], node);
    } else if (m[4] !== undefined || m[6] !== undefined) {
      node = document.createElement("em");
      mdInline(m[4] !== undefined ? m[4] : m[6], node);
    } else {
      const url = m[8];
      if (/^https?:\/\//i.test(url)) {
        node = document.createElement("a");
        node.href = url;
        node.rel = "noopener noreferrer nofollow";
        node.target = "_blank";
        node.textContent = m[7];
      } else {
        node = document.createTextNode(m[0]);   // other schemes (javascript:, data:) stay text
      }
    }
    parent.appendChild(node);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

// Renders `text` into `parent` (emptied first). An unclosed code fence (a reply still
// streaming) renders as a code block up to the end.
function renderMarkdown(text, parent) {
  parent.textContent = "";
  const lines = text.split("\n");
  let para = null, list = null;
  const endBlocks = () => { para = null; list = null; };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = /^\s*(```|~~~)\s*([\w+-]*)\s*$/.exec(line);
    if (fence) {
      endBlocks();
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (fence[2]) code.dataset.lang = fence[2];
      const body = [];
      for (i++; i < lines.length && !new RegExp("^\\s*" + fence[1] + "\\s*$").test(lines[i]); i++)
        body.push(lines[i]);
      code.textContent = body.join("\n");
      pre.appendChild(code);
      parent.appendChild(pre);
      continue;
    }
    if (!line.trim()) { endBlocks(); continue; }
    const head = /^(#{1,6})\s+(.*)$/.exec(line);
    if (head) {
      endBlocks();
      const h = document.createElement("h" + Math.min(6, head[1].length + 2));
      mdInline(head[2], h);
      parent.appendChild(h);
      continue;
    }
    const item = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(line);
    if (item) {
      const tag = /\d/.test(item[1]) ? "OL" : "UL";
      if (!list || list.tagName !== tag) {
        para = null;
        list = document.createElement(tag);
        if (tag === "OL") list.start = parseInt(item[1], 10);
        parent.appendChild(list);
      }
      const li = document.createElement("li");
      mdInline(item[2], li);
      list.appendChild(li);
      continue;
    }
    const quote = /^\s*>\s?(.*)$/.exec(line);
    if (quote) {
      endBlocks();
      const bq = document.createElement("blockquote");
      mdInline(quote[1], bq);
      parent.appendChild(bq);
      continue;
    }
    if (list && /^\s{2,}\S/.test(line)) {     // a list item's continuation line
      const li = list.lastElementChild;
      li.appendChild(document.createTextNode(" "));
      mdInline(line.trim(), li);
      continue;
    }
    list = null;
    if (!para) {
      para = document.createElement("p");
      parent.appendChild(para);
    } else {
      para.appendChild(document.createElement("br"));
    }
    mdInline(line, para);
  }
}
