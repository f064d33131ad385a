// SPDX-License-Identifier: Apache-2.0
// DOM helpers. Every piece of API data enters the page as a text node or an
// attribute value set through the DOM, never parsed as HTML.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) {
      continue;
    }
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2), v);
    } else if (k === 'class') {
      el.className = v;
    } else if (k === 'value') {
      el.value = v;
    } else {
      el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) {
      continue;
    }
    if (Array.isArray(c)) {
      append(el, c);
    } else if (c instanceof Node) {
      el.append(c);
    } else {
      el.append(document.createTextNode(String(c)));
    }
  }
}

// A hash link to a page of the dashboard (parts are URI-encoded).
export function link(text, ...parts) {
  return h('a', { href: `#/${parts.map(encodeURIComponent).join('/')}` }, text);
}

export function table(headers, rows, attrs) {
  return h('table', attrs || {},
    h('thead', {}, h('tr', {}, headers.map((t) => h('th', { scope: 'col' }, t)))),
    h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: headers.length, class: 'empty' }, 'None'))));
}

export function badge(text, kind) {
  return h('span', { class: `badge ${kind || ''}` }, text);
}

// Redraws `container` with `draw()` whenever one of `sources` changes (at
// most once per animation frame). Returns the function that stops it.
export function reactive(container, sources, draw) {
  let pending = false;
  const redraw = () => {
    if (pending) {
      return;
    }
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      container.replaceChildren(draw());
    });
  };
  const offs = sources.map((s) => s.on(redraw));
  container.replaceChildren(draw());
  return () => offs.forEach((off) => off());
}
