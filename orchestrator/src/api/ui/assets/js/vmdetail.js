// SPDX-License-Identifier: Apache-2.0
// One VM: spec, phase, node, IPs, disks, conditions, and its actions.

import { ApiError, mergePatch, paths, remove, request } from './api.js';
import { badge, h, link, reactive, table } from './dom.js';
import { bytes, cores, ips, memory, phaseClass, runStrategy, vmPhase } from './format.js';
import { toYaml } from './yaml.js';

// What the start/stop subresource does for the Always and Halted strategies
// (examples/src/server.rs), as a merge patch of the VM's spec.
function strategyPatch(vm, s) {
  const spec = vm.spec || {};
  if (spec.running !== undefined && spec.running !== null && !spec.runStrategy) {
    return { spec: { running: s !== 'Halted' } };
  }
  return { spec: { running: null, runStrategy: s } };
}

// start / stop / restart: the cluster binary's subresource when this API
// server serves it, else the same change through the VM (and its instance).
export async function vmAction(ctx, vm, verb) {
  const ns = vm.metadata.namespace;
  const name = vm.metadata.name;
  try {
    await request('PUT', paths.vmVerb(ns, name, verb), {});
    return;
  } catch (e) {
    if (!(e instanceof ApiError) || (e.status !== 404 && e.status !== 405)) {
      throw e;
    }
  }
  if (runStrategy(vm) === 'Manual') {
    throw new Error(`this API server has no ${verb} subresource, and a Manual VM only changes through it`);
  }
  if (verb === 'start') {
    await mergePatch(paths.vm(ns, name), strategyPatch(vm, 'Always'));
  } else if (verb === 'stop') {
    await mergePatch(paths.vm(ns, name), strategyPatch(vm, 'Halted'));
  } else {
    const vmi = ctx.live.vmis.get(ns, name);
    if (!vmi) {
      throw new Error(`VM ${ns}/${name} is not running; use start`);
    }
    // The VM controller creates a new instance for a VM that should run.
    await remove(paths.vmi(ns, name), { kind: 'DeleteOptions', apiVersion: 'v1', preconditions: { uid: vmi.metadata.uid } });
  }
}

function actions(ctx, vm, vmi) {
  if (!ctx.write) {
    return null;
  }
  const ns = vm.metadata.namespace;
  const name = vm.metadata.name;
  const run = (verb) => async () => {
    ctx.status(`${verb} ${ns}/${name}…`);
    try {
      await vmAction(ctx, vm, verb);
      ctx.status(`${verb}: requested for ${ns}/${name}`);
    } catch (e) {
      ctx.status(`${verb} ${ns}/${name} failed: ${e.message}`, true);
    }
  };
  const halted = runStrategy(vm) === 'Halted';
  const del = h('button', { type: 'button', id: 'action-delete', class: 'danger' }, 'Delete');
  del.addEventListener('click', async () => {
    if (del.dataset.armed !== 'yes') {
      del.dataset.armed = 'yes';
      del.textContent = 'Confirm delete';
      return;
    }
    try {
      await remove(paths.vm(ns, name));
      ctx.status(`deleted ${ns}/${name}`);
      ctx.navigate('#/vms');
    } catch (e) {
      ctx.status(`delete ${ns}/${name} failed: ${e.message}`, true);
    }
  });
  return h('div', { class: 'actions' },
    h('button', { type: 'button', id: 'action-start', disabled: !halted && !!vmi, onclick: run('start') }, 'Start'),
    h('button', { type: 'button', id: 'action-stop', disabled: halted && !vmi, onclick: run('stop') }, 'Stop'),
    h('button', { type: 'button', id: 'action-restart', disabled: !vmi, onclick: run('restart') }, 'Restart'),
    h('a', { class: 'button', href: `#/console/${encodeURIComponent(ns)}/${encodeURIComponent(name)}` }, 'Console'),
    del);
}

function conditions(title, obj) {
  const cs = (obj && obj.status && obj.status.conditions) || [];
  return h('section', { class: 'card' }, h('h2', {}, title),
    table(['Type', 'Status', 'Reason', 'Message'], cs.map((c) => h('tr', {},
      h('td', {}, c.type || ''), h('td', {}, c.status || ''), h('td', {}, c.reason || ''), h('td', {}, c.message || '')))));
}

function disks(vm) {
  const spec = ((vm.spec || {}).template || {}).spec || {};
  const vols = new Map((spec.volumes || []).map((v) => [v.name, v]));
  const ns = vm.metadata.namespace;
  return (((spec.domain || {}).devices || {}).disks || []).map((d) => {
    const v = vols.get(d.name) || {};
    const kind = Object.keys(v).find((k) => k !== 'name') || '—';
    const claim = v.persistentVolumeClaim && v.persistentVolumeClaim.claimName;
    const dv = v.dataVolume && v.dataVolume.name;
    const bus = (d.disk && d.disk.bus) || (d.cdrom && 'cdrom') || '';
    return h('tr', {}, h('td', {}, d.name || ''), h('td', {}, bus), h('td', {}, kind),
      h('td', {}, claim || dv ? link(claim || dv, 'volumes') : '—'), h('td', {}, ns));
  });
}

function draw(ctx, ns, name) {
  const vm = ctx.live.vms.get(ns, name);
  if (!vm) {
    return h('div', {}, h('h1', {}, `${ns}/${name}`),
      h('p', {}, ctx.live.vms.synced ? 'No such VM (it may have been deleted).' : 'Loading…'), link('All VMs', 'vms'));
  }
  const vmi = ctx.live.vmis.get(ns, name);
  const phase = vmPhase(vm, vmi);
  const st = (vmi && vmi.status) || {};
  const ifaces = st.interfaces || [];
  return h('div', { id: 'vm-detail', 'data-vm': `${ns}/${name}` },
    h('div', { class: 'title' }, h('h1', {}, name), badge(phase, phaseClass(phase))),
    actions(ctx, vm, vmi),
    h('section', { class: 'card' }, h('h2', {}, 'Summary'),
      h('dl', { class: 'facts' },
        h('dt', {}, 'Namespace'), h('dd', {}, ns),
        h('dt', {}, 'Run strategy'), h('dd', { id: 'vm-strategy' }, runStrategy(vm)),
        h('dt', {}, 'Phase'), h('dd', { id: 'vm-phase' }, phase),
        h('dt', {}, 'Node'), h('dd', { id: 'vm-node' }, st.nodeName || '—'),
        h('dt', {}, 'IP addresses'), h('dd', { id: 'vm-ips' }, ips(vmi).join(', ') || '—'),
        h('dt', {}, 'CPU'), h('dd', {}, String(cores(vm))),
        h('dt', {}, 'Memory'), h('dd', {}, bytes(memory(vm))))),
    h('section', { class: 'card' }, h('h2', {}, 'Disks'),
      table(['Disk', 'Bus', 'Source', 'Volume', 'Namespace'], disks(vm))),
    h('section', { class: 'card' }, h('h2', {}, 'Interfaces'),
      table(['Name', 'IP', 'MAC'], ifaces.map((i) => h('tr', {}, h('td', {}, i.name || ''),
        h('td', {}, (i.ipAddresses || [i.ipAddress]).filter(Boolean).join(', ')), h('td', {}, i.mac || ''))))),
    conditions('VM conditions', vm),
    conditions('Instance conditions', vmi),
    h('section', { class: 'card' }, h('h2', {}, 'YAML'), h('pre', { class: 'yaml', id: 'vm-yaml' }, toYaml(vm))));
}

export function mount(page, ctx, ns, name) {
  return reactive(page, [ctx.live.vms, ctx.live.vmis], () => draw(ctx, ns, name));
}
