// SPDX-License-Identifier: Apache-2.0
// Volumes: size, replicas with their nodes, state and epochs, the engine's
// attachment, import progress.

import { badge, h, reactive, table } from './dom.js';
import { age, phaseClass, volumeHealth } from './format.js';

function replicaList(v) {
  const rs = (v.status && v.status.replicas) || [];
  if (!rs.length) {
    return '—';
  }
  return h('ul', { class: 'replicas' }, rs.map((r) => h('li', {},
    badge(r.state || 'Unknown', phaseClass(r.state)), ' ', r.nodeName || '?',
    r.epoch !== undefined ? ` (epoch ${r.epoch}${r.writeIndex !== undefined ? `, write ${r.writeIndex}` : ''})` : '',
    r.message ? h('small', {}, ` ${r.message}`) : null)));
}

function progress(v) {
  const p = v.status && v.status.progress;
  if (!p) {
    return '—';
  }
  const n = parseFloat(p);
  return h('span', {}, Number.isFinite(n) ? h('progress', { max: 100, value: n }, p) : null, ` ${p}`);
}

function draw(ctx) {
  const vols = ctx.live.volumes;
  const rows = vols.list().map((v) => {
    const hl = volumeHealth(v);
    const st = v.status || {};
    const att = st.attachment;
    return h('tr', { 'data-volume': `${v.metadata.namespace}/${v.metadata.name}` },
      h('td', {}, v.metadata.name),
      h('td', {}, v.metadata.namespace),
      h('td', {}, (v.spec && v.spec.size) || '—'),
      h('td', {}, badge(hl.phase, phaseClass(hl.phase))),
      h('td', {}, `${hl.healthy}/${hl.want}`),
      h('td', {}, replicaList(v)),
      h('td', {}, att ? `${att.nodeName}${att.instance ? ` (${att.instance})` : ''}` : '—'),
      h('td', {}, progress(v)),
      h('td', {}, age(v.metadata.creationTimestamp)));
  });
  return h('div', {}, vols.error ? h('p', { class: 'error', role: 'alert' }, vols.error.message) : null,
    table(['Name', 'Namespace', 'Size', 'Phase', 'Healthy', 'Replicas (node, state)', 'Attached to', 'Import', 'Age'], rows, { id: 'volume-table' }));
}

export function mount(page, ctx) {
  const body = h('div', {});
  page.append(h('h1', {}, 'Volumes'), body);
  return reactive(body, [ctx.live.volumes], () => draw(ctx));
}
