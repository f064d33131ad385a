// SPDX-License-Identifier: Apache-2.0
// Create a VM from a form: the objects (a sheaf Volume for a new disk, and a
// KubeVirt VirtualMachine) are shown as YAML before they are applied.

import { create, paths } from './api.js';
import { h } from './dom.js';
import { toYaml } from './yaml.js';

const NAME = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;

function field(label, id, input, hint) {
  input.id = id;
  input.name = id;
  return h('div', { class: 'field' }, h('label', { for: id }, label), input, hint ? h('small', {}, hint) : null);
}

// Cloud-init user data with the SSH key added (a #cloud-config document).
export function userData(text, key) {
  const t = text.trim();
  key = key.trim();
  if (!key) {
    return t ? `${t}\n` : '';
  }
  if (t && !t.startsWith('#cloud-config')) {
    throw new Error('an SSH key can only be added to #cloud-config user data (not to a script)');
  }
  const base = t || '#cloud-config';
  return `${base}\nssh_authorized_keys:\n  - ${JSON.stringify(key)}\n`;
}

// The objects the form describes; throws an Error naming the bad field.
export function objects(v) {
  if (!NAME.test(v.name) || v.name.length > 63) {
    throw new Error('name: lower-case letters, digits and "-", at most 63 characters');
  }
  if (!NAME.test(v.namespace)) {
    throw new Error('namespace: not a valid name');
  }
  const cpu = Number(v.cpu);
  const mem = Number(v.memory);
  const disk = Number(v.disk);
  const replicas = Number(v.replicas);
  if (!Number.isInteger(cpu) || cpu < 1 || cpu > 64) {
    throw new Error('CPU: a whole number of cores, 1 to 64');
  }
  if (!Number.isInteger(mem) || mem < 16) {
    throw new Error('memory: whole MiB, at least 16');
  }
  if (!Number.isInteger(disk) || disk < 1) {
    throw new Error('disk size: whole GiB, at least 1');
  }
  if (!Number.isInteger(replicas) || replicas < 1 || replicas > 5) {
    throw new Error('replicas: 1 to 5');
  }
  const out = [];
  let claim = v.volume;
  if (v.source === 'image') {
    if (!v.image.trim()) {
      throw new Error('image: give the image path or URL the disk is filled from');
    }
    claim = `${v.name}-disk`;
    out.push({
      apiVersion: 'sheaf.dev/v1',
      kind: 'Volume',
      metadata: { name: claim, namespace: v.namespace },
      spec: { size: `${disk}Gi`, replicas, source: { image: v.image.trim() } },
    });
  } else if (!claim) {
    throw new Error('volume: choose an existing volume');
  }
  const disks = [{ name: 'rootdisk', disk: { bus: 'virtio' } }];
  const volumes = [{ name: 'rootdisk', persistentVolumeClaim: { claimName: claim } }];
  const ud = userData(v.userData, v.sshKey);
  if (ud) {
    disks.push({ name: 'cloudinitdisk', disk: { bus: 'virtio' } });
    volumes.push({ name: 'cloudinitdisk', cloudInitNoCloud: { userData: ud } });
  }
  out.push({
    apiVersion: 'kubevirt.io/v1',
    kind: 'VirtualMachine',
    metadata: { name: v.name, namespace: v.namespace, labels: { 'kubevirt.io/vm': v.name } },
    spec: {
      runStrategy: v.start ? 'Always' : 'Halted',
      template: {
        metadata: { labels: { 'kubevirt.io/vm': v.name } },
        spec: {
          domain: {
            cpu: { cores: cpu },
            resources: { requests: { memory: `${mem}Mi` } },
            devices: { disks },
          },
          volumes,
        },
      },
    },
  });
  return out;
}

export function mount(page, ctx) {
  const inputs = {
    name: h('input', { required: true, autocomplete: 'off' }),
    namespace: h('input', { value: 'default', required: true }),
    source: h('select', {}, h('option', { value: 'image' }, 'New disk from an image'), h('option', { value: 'volume' }, 'Existing volume')),
    image: h('input', { placeholder: '/var/lib/sheaf/images/cirros.img' }),
    volume: h('select', {}),
    cpu: h('input', { type: 'number', min: 1, max: 64, value: '1' }),
    memory: h('input', { type: 'number', min: 16, value: '512' }),
    disk: h('input', { type: 'number', min: 1, value: '10' }),
    replicas: h('input', { type: 'number', min: 1, max: 5, value: '3' }),
    sshKey: h('input', { placeholder: 'ssh-ed25519 AAAA… user@host', autocomplete: 'off' }),
    userData: h('textarea', { rows: 6 }, '#cloud-config\n'),
    start: h('input', { type: 'checkbox' }),
  };
  for (const vol of ctx.live.volumes.list()) {
    const key = `${vol.metadata.namespace}/${vol.metadata.name}`;
    inputs.volume.append(h('option', { value: vol.metadata.name, 'data-ns': vol.metadata.namespace }, key));
  }
  const preview = h('pre', { class: 'yaml', id: 'create-preview', hidden: true });
  const error = h('p', { class: 'error', id: 'create-error', role: 'alert', hidden: true });
  const apply = h('button', { type: 'button', id: 'create-apply', disabled: true }, 'Create');
  let pending = null;
  const values = () => Object.fromEntries(Object.entries(inputs).map(([k, el]) => [k, el.type === 'checkbox' ? el.checked : el.value]));
  const showPreview = () => {
    error.hidden = true;
    try {
      pending = objects(values());
      preview.textContent = pending.map(toYaml).join('---\n');
      preview.hidden = false;
      apply.disabled = false;
    } catch (e) {
      pending = null;
      preview.hidden = true;
      apply.disabled = true;
      error.textContent = e.message;
      error.hidden = false;
    }
  };
  // Any edit invalidates the preview: what is applied is what was shown.
  for (const el of Object.values(inputs)) {
    el.addEventListener('input', () => {
      pending = null;
      apply.disabled = true;
    });
  }
  apply.addEventListener('click', async () => {
    if (!pending) {
      return;
    }
    apply.disabled = true;
    const objs = pending;
    try {
      for (const o of objs) {
        const p = o.kind === 'Volume' ? paths.volumes(o.metadata.namespace) : paths.vms(o.metadata.namespace);
        await create(p, o);
      }
      const vm = objs[objs.length - 1].metadata;
      ctx.status(`created ${vm.namespace}/${vm.name}`);
      ctx.navigate(`#/vms/${encodeURIComponent(vm.namespace)}/${encodeURIComponent(vm.name)}`);
    } catch (e) {
      error.textContent = `The API refused it: ${e.message}`;
      error.hidden = false;
    }
  });
  const form = h('form', { id: 'create-form', class: 'card form' },
    field('Name', 'create-name', inputs.name),
    field('Namespace', 'create-namespace', inputs.namespace),
    field('Disk', 'create-source', inputs.source),
    field('Image', 'create-image', inputs.image, 'path or URL the new volume is filled from'),
    field('Existing volume', 'create-volume', inputs.volume),
    field('CPU cores', 'create-cpu', inputs.cpu),
    field('Memory (MiB)', 'create-memory', inputs.memory),
    field('Disk size (GiB)', 'create-disk', inputs.disk),
    field('Disk replicas', 'create-replicas', inputs.replicas),
    field('SSH public key', 'create-ssh', inputs.sshKey, 'added to the #cloud-config user data'),
    field('Cloud-init user data', 'create-userdata', inputs.userData),
    field('Start after creating', 'create-start', inputs.start),
    h('div', { class: 'actions' }, h('button', { type: 'submit', id: 'create-preview-button' }, 'Preview YAML'), apply));
  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    showPreview();
  });
  page.append(h('h1', {}, 'Create a virtual machine'), form, error, preview);
  return null;
}
