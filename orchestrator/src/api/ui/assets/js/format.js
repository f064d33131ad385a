// SPDX-License-Identifier: Apache-2.0
// Reading the objects: phases, health, quantities, ages.

const BIN = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50 };
const DEC = { n: 1e-9, u: 1e-6, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15 };

// A Kubernetes quantity ("512Mi", "2", "500m") as a number, or NaN.
export function quantity(q) {
  if (q === undefined || q === null) {
    return NaN;
  }
  const m = /^([0-9.]+)([A-Za-z]*)$/.exec(String(q).trim());
  if (!m) {
    return NaN;
  }
  const n = Number(m[1]);
  if (m[2] === '') {
    return n;
  }
  const f = BIN[m[2]] || DEC[m[2]];
  return f ? n * f : NaN;
}

export function bytes(n) {
  if (!Number.isFinite(n)) {
    return '—';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n >= 10 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

export function age(ts) {
  const t = Date.parse(ts || '');
  if (!Number.isFinite(t)) {
    return '—';
  }
  const s = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (s < 120) {
    return `${s}s`;
  }
  if (s < 7200) {
    return `${Math.round(s / 60)}m`;
  }
  if (s < 172800) {
    return `${Math.round(s / 3600)}h`;
  }
  return `${Math.round(s / 86400)}d`;
}

export function runStrategy(vm) {
  const spec = vm.spec || {};
  if (spec.runStrategy) {
    return spec.runStrategy;
  }
  return spec.running ? 'Always' : 'Halted';
}

// What a VM is doing: its instance's phase, else the VM's printable status.
export function vmPhase(vm, vmi) {
  if (vmi && vmi.status && vmi.status.phase) {
    return vmi.metadata && vmi.metadata.deletionTimestamp ? 'Terminating' : vmi.status.phase;
  }
  if (vm && vm.status && vm.status.printableStatus) {
    return vm.status.printableStatus;
  }
  return runStrategy(vm || {}) === 'Halted' ? 'Stopped' : 'Starting';
}

export function phaseClass(p) {
  switch (p) {
    case 'Running':
    case 'Ready':
    case 'Healthy':
    case 'Available':
    case 'Attached':
    case 'Succeeded':
      return 'good';
    case 'Failed':
    case 'Faulted':
    case 'NotReady':
    case 'CrashLoopBackOff':
      return 'bad';
    case 'Stopped':
    case 'Halted':
    case 'Unknown':
      return 'idle';
    default:
      return 'warn';
  }
}

export function ips(vmi) {
  const out = [];
  for (const i of (vmi && vmi.status && vmi.status.interfaces) || []) {
    for (const a of i.ipAddresses || (i.ipAddress ? [i.ipAddress] : [])) {
      if (!out.includes(a)) {
        out.push(a);
      }
    }
  }
  return out;
}

export function condition(obj, type) {
  return ((obj && obj.status && obj.status.conditions) || []).find((c) => c.type === type);
}

export function nodeHealth(node) {
  const c = condition(node, 'Ready');
  if (!c) {
    return 'Unknown';
  }
  return c.status === 'True' ? 'Ready' : 'NotReady';
}

export function cores(vm) {
  const d = (((vm.spec || {}).template || {}).spec || {}).domain || {};
  const c = d.cpu || {};
  const n = (c.cores || 1) * (c.sockets || 1) * (c.threads || 1);
  if (d.cpu) {
    return n;
  }
  const req = d.resources && d.resources.requests && d.resources.requests.cpu;
  return req ? quantity(req) : 1;
}

export function memory(vm) {
  const d = (((vm.spec || {}).template || {}).spec || {}).domain || {};
  const m = (d.memory && d.memory.guest) || (d.resources && d.resources.requests && d.resources.requests.memory);
  return quantity(m);
}

export function volumeHealth(v) {
  const st = v.status || {};
  const want = (v.spec && v.spec.replicas) || 3;
  const healthy = (st.replicas || []).filter((r) => r.state === 'Healthy').length;
  return { want, healthy, phase: st.phase || 'Pending' };
}
