// SPDX-License-Identifier: Apache-2.0
// Nodes: health, capacity, what runs on them; cordon, uncordon and drain
// (cordon, then a live migration for each running instance, as `sheaf node
// drain` does).

import { create, mergePatch, paths } from './api.js';
import { badge, h, reactive, table } from './dom.js';
import { bytes, nodeHealth, phaseClass, quantity } from './format.js';

async function cordon(ctx, name, on) {
  try {
    await mergePatch(paths.node(name), { spec: { unschedulable: on } });
    ctx.status(`node ${name} ${on ? 'cordoned' : 'uncordoned'}`);
  } catch (e) {
    ctx.status(`${on ? 'cordon' : 'uncordon'} ${name} failed: ${e.message}`, true);
  }
}

async function drain(ctx, name, moving) {
  try {
    await mergePatch(paths.node(name), { spec: { unschedulable: true } });
    for (const vmi of moving) {
      const ns = vmi.metadata.namespace;
      await create(paths.migrations(ns), {
        apiVersion: 'kubevirt.io/v1',
        kind: 'VirtualMachineInstanceMigration',
        metadata: { generateName: `${vmi.metadata.name}-drain-`, namespace: ns },
        spec: { vmiName: vmi.metadata.name },
      });
    }
    ctx.status(`node ${name} cordoned; ${moving.length} migration(s) created`);
  } catch (e) {
    ctx.status(`drain ${name} failed: ${e.message}`, true);
  }
}

function draw(ctx) {
  const vmis = ctx.live.vmis.list();
  const vols = ctx.live.volumes.list();
  const rows = ctx.live.nodes.list().map((n) => {
    const name = n.metadata.name;
    const hl = nodeHealth(n);
    const cap = (n.status && n.status.capacity) || {};
    const alloc = (n.status && n.status.allocatable) || cap;
    const here = vmis.filter((i) => i.status && i.status.nodeName === name);
    const moving = here.filter((i) => i.status.phase === 'Running');
    const replicas = vols.filter((v) => ((v.status && v.status.replicas) || []).some((r) => r.nodeName === name));
    const cordoned = !!(n.spec && n.spec.unschedulable);
    const buttons = ctx.write ? h('div', { class: 'actions' },
      cordoned
        ? h('button', { type: 'button', 'data-action': 'uncordon', onclick: () => cordon(ctx, name, false) }, 'Uncordon')
        : h('button', { type: 'button', 'data-action': 'cordon', onclick: () => cordon(ctx, name, true) }, 'Cordon'),
      h('button', {
        type: 'button',
        'data-action': 'drain',
        title: moving.length ? `moves: ${moving.map((i) => i.metadata.name).join(', ')}` : 'no running VM to move',
        onclick: () => drain(ctx, name, moving),
      }, `Drain (${moving.length} VM${moving.length === 1 ? '' : 's'} move)`)) : null;
    return h('tr', { 'data-node': name },
      h('td', {}, name),
      h('td', {}, badge(hl, phaseClass(hl))),
      h('td', { class: 'schedulable' }, cordoned ? 'cordoned' : 'schedulable'),
      h('td', {}, (n.spec && n.spec.zone) || '—'),
      h('td', {}, `${alloc.cpu || '—'} / ${cap.cpu || '—'}`),
      h('td', {}, `${bytes(quantity(alloc.memory))} / ${bytes(quantity(cap.memory))}`),
      h('td', {}, here.length ? here.map((i) => i.metadata.name).join(', ') : '—'),
      h('td', {}, String(replicas.length)),
      h('td', {}, buttons));
  });
  return h('div', {}, ctx.live.nodes.error ? h('p', { class: 'error', role: 'alert' }, ctx.live.nodes.error.message) : null,
    table(['Node', 'Health', 'Scheduling', 'Zone', 'CPU (alloc / cap)', 'Memory (alloc / cap)', 'VMs', 'Replicas', ''], rows, { id: 'node-table' }));
}

export function mount(page, ctx) {
  const body = h('div', {});
  page.append(h('h1', {}, 'Nodes'), body);
  const l = ctx.live;
  return reactive(body, [l.nodes, l.vmis, l.volumes], () => draw(ctx));
}
