// SPDX-License-Identifier: Apache-2.0
// The VM list: every VirtualMachine with its instance's phase, node and IPs.

import { badge, h, link, reactive, table } from './dom.js';
import { age, bytes, cores, ips, memory, phaseClass, vmPhase } from './format.js';

function draw(ctx, filter) {
  const { vms, vmis } = ctx.live;
  const f = filter.value.trim().toLowerCase();
  const rows = vms.list()
    .filter((vm) => !f || `${vm.metadata.namespace}/${vm.metadata.name}`.toLowerCase().includes(f))
    .map((vm) => {
      const ns = vm.metadata.namespace;
      const name = vm.metadata.name;
      const vmi = vmis.get(ns, name);
      const phase = vmPhase(vm, vmi);
      return h('tr', { 'data-vm': `${ns}/${name}` },
        h('td', {}, link(name, 'vms', ns, name)),
        h('td', {}, ns),
        h('td', { class: 'phase' }, badge(phase, phaseClass(phase))),
        h('td', {}, (vmi && vmi.status && vmi.status.nodeName) || '—'),
        h('td', {}, ips(vmi).join(', ') || '—'),
        h('td', {}, String(cores(vm))),
        h('td', {}, bytes(memory(vm))),
        h('td', {}, age(vm.metadata.creationTimestamp)));
    });
  const errors = [vms, vmis].filter((c) => c.error).map((c) => h('p', { class: 'error', role: 'alert' }, `${c.kind}: ${c.error.message}`));
  return h('div', {}, errors, table(['Name', 'Namespace', 'Phase', 'Node', 'IP', 'CPU', 'Memory', 'Age'], rows, { id: 'vm-table' }));
}

export function mount(page, ctx) {
  const filter = h('input', { id: 'vm-filter', type: 'search', placeholder: 'namespace/name' });
  const body = h('div', {});
  page.append(
    h('div', { class: 'title' }, h('h1', {}, 'Virtual machines'), ctx.write ? h('a', { class: 'button', href: '#/create' }, 'Create') : null),
    h('label', { for: 'vm-filter' }, 'Filter '), filter, body);
  const off = reactive(body, [ctx.live.vms, ctx.live.vmis], () => draw(ctx, filter));
  filter.addEventListener('input', () => body.replaceChildren(draw(ctx, filter)));
  return off;
}
