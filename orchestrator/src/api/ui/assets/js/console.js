// SPDX-License-Identifier: Apache-2.0
// A VM's serial console: the cluster binary's console subresource streamed
// into the page (a chunked response read as it arrives), input sent with
// POST. Output is shown as text (escape sequences stripped), never as HTML.

import { headers, paths, request } from './api.js';
import { h, link } from './dom.js';

// CSI / OSC escape sequences and other control characters but \n and \t.
const ESCAPES = /\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f]/g;

export function clean(s) {
  return s.replace(/\r\n/g, '\n').replace(ESCAPES, '');
}

const MAX = 200000;

export function mount(page, ctx, ns, name) {
  const out = h('pre', { class: 'console', id: 'console-output', tabindex: 0, 'aria-label': 'Serial console output' });
  const state = h('p', { id: 'console-state', role: 'status' }, 'Connecting…');
  const input = h('input', { id: 'console-input', autocomplete: 'off', placeholder: 'type a line, Enter sends it' });
  const abort = new AbortController();
  page.append(
    h('div', { class: 'title' }, h('h1', {}, `Console: ${ns}/${name}`), link('Back to the VM', 'vms', ns, name)),
    state, out,
    ctx.write ? h('form', { id: 'console-form', class: 'console-form' }, h('label', { for: 'console-input' }, 'Input '), input) : null);
  const form = page.querySelector('#console-form');
  if (form) {
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const line = `${input.value}\n`;
      input.value = '';
      try {
        await request('POST', paths.console(ns, name), line, 'application/octet-stream');
      } catch (e) {
        state.textContent = `Input refused: ${e.message}`;
      }
    });
  }
  (async () => {
    try {
      const r = await fetch(paths.console(ns, name), { headers: headers({ Accept: '*/*' }), credentials: 'omit', cache: 'no-store', signal: abort.signal });
      if (!r.ok) {
        let msg = await r.text();
        try {
          msg = JSON.parse(msg).message || msg;
        } catch (_) {
          // not a Status
        }
        state.textContent = r.status === 404
          ? `No console: ${msg} (the console is served by the sheaf cluster binary)`
          : `No console (${r.status}): ${msg}`;
        return;
      }
      state.textContent = 'Live.';
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) {
          break;
        }
        let text = out.textContent + clean(value);
        if (text.length > MAX) {
          text = text.slice(text.length - MAX);
        }
        out.textContent = text;
        out.scrollTop = out.scrollHeight;
      }
      state.textContent = 'The console stream ended.';
    } catch (e) {
      if (!abort.signal.aborted) {
        state.textContent = `Console failed: ${e.message}`;
      }
    }
  })();
  return () => abort.abort();
}
