// SPDX-License-Identifier: Apache-2.0
// Cluster overview: nodes with health and capacity, VMs by phase, volumes by
// health, and the latest changes the watch streams delivered.

import { badge, h, link, reactive, table } from './dom.js';
import { bytes, nodeHealth, phaseClass, quantity, vmPhase, volumeHealth } from './format.js';

function counts(values) {
  const m = new Map();
  for (const v of values) {
    m.set(v, (m.get(v) || 0) + 1);
  }
  return [...m.entries()].sort((a, b) => a[0].localeCompare(b[0]));
}

function tally(title, id, entries, total) {
  return h('section', { class: 'card tally', id },
    h('h2', {}, title),
    h('p', { class: 'big' }, String(total)),
    h('ul', {}, entries.map(([k, n]) => h('li', {}, badge(k, phaseClass(k)), ' ', String(n)))));
}

function draw(ctx) {
  const { vms, vmis, volumes, nodes } = ctx.live;
  const vmList = vms.list();
  const vmiOf = (vm) => vmis.get(vm.metadata.namespace, vm.metadata.name);
  const vols = volumes.list();
  const nodeList = nodes.list();
  const replicasOn = (n) => vols.reduce((acc, v) => acc + ((v.status && v.status.replicas) || []).filter((r) => r.nodeName === n).length, 0);
  const vmsOn = (n) => vmis.list().filter((i) => i.status && i.status.nodeName === n).length;
  let cpu = 0;
  let mem = 0;
  for (const n of nodeList) {
    const cap = (n.status && (n.status.allocatable || n.status.capacity)) || {};
    cpu += quantity(cap.cpu) || 0;
    mem += quantity(cap.memory) || 0;
  }
  const errors = Object.values(ctx.live).filter((c) => c.error).map((c) => h('p', { class: 'error', role: 'alert' }, `${c.kind}: ${c.error.message}`));
  return h('div', {},
    h('h1', {}, 'Cluster overview'),
    errors,
    h('div', { class: 'tallies' },
      tally('Nodes', 'tally-nodes', counts(nodeList.map(nodeHealth)), nodeList.length),
      tally('Virtual machines', 'tally-vms', counts(vmList.map((vm) => vmPhase(vm, vmiOf(vm)))), vmList.length),
      tally('Volumes', 'tally-volumes', counts(vols.map((v) => volumeHealth(v).phase)), vols.length),
      h('section', { class: 'card tally' }, h('h2', {}, 'Allocatable'), h('p', { class: 'big' }, `${cpu} CPU`), h('p', {}, bytes(mem)))),
    h('section', { class: 'card' },
      h('h2', {}, 'Nodes'),
      table(['Node', 'Health', 'Schedulable', 'Zone', 'CPU', 'Memory', 'VMs', 'Replicas'], nodeList.map((n) => {
        const cap = (n.status && (n.status.allocatable || n.status.capacity)) || {};
        const hl = nodeHealth(n);
        return h('tr', {},
          h('td', {}, link(n.metadata.name, 'nodes')),
          h('td', {}, badge(hl, phaseClass(hl))),
          h('td', {}, n.spec && n.spec.unschedulable ? 'cordoned' : 'yes'),
          h('td', {}, (n.spec && n.spec.zone) || '—'),
          h('td', {}, cap.cpu || '—'),
          h('td', {}, bytes(quantity(cap.memory))),
          h('td', {}, String(vmsOn(n.metadata.name))),
          h('td', {}, String(replicasOn(n.metadata.name))));
      }), { id: 'overview-nodes' })),
    h('section', { class: 'card' },
      h('h2', {}, 'Recent changes'),
      h('p', { class: 'hint' }, 'What the watch streams delivered since you logged in (the API has no Event kind).'),
      h('ol', { class: 'feed', id: 'feed' }, ctx.feed.entries.map((e) => h('li', {},
        h('time', {}, e.at.toLocaleTimeString()), ' ', badge(e.type, e.type === 'DELETED' ? 'bad' : 'idle'), ' ', `${e.kind} ${e.key}`)))));
}

export function mount(page, ctx) {
  const l = ctx.live;
  return reactive(page, [l.vms, l.vmis, l.volumes, l.nodes, ctx.feed], () => draw(ctx));
}
