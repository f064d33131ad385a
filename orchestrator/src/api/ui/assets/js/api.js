// SPDX-License-Identifier: Apache-2.0
// The API client: the same authenticated HTTP API kubectl uses. The token
// lives in sessionStorage (this tab only) and travels in the Authorization
// header; no cookie is ever set, so a cross-site request carries nothing.

const KEY = 'sheaf.token';

export function token() {
  return sessionStorage.getItem(KEY) || '';
}

export function setToken(t) {
  sessionStorage.setItem(KEY, t);
}

export function clearToken() {
  sessionStorage.removeItem(KEY);
}

// A refusal or failure of the API, with the Kubernetes Status when it sent one.
export class ApiError extends Error {
  constructor(status, body, text) {
    const msg = body && typeof body.message === 'string' ? body.message : (text || '').slice(0, 300);
    super(`${status} ${(body && body.reason) || ''}: ${msg}`.trim());
    this.status = status;
    this.body = body;
  }
}

export function headers(extra) {
  return Object.assign({ Authorization: `Bearer ${token()}`, Accept: 'application/json' }, extra || {});
}

export async function request(method, path, body, contentType) {
  const init = { method, headers: headers(), credentials: 'omit', cache: 'no-store' };
  if (body !== undefined) {
    init.headers['Content-Type'] = contentType || 'application/json';
    init.body = typeof body === 'string' ? body : JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const text = await r.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch (_) {
    json = null;
  }
  if (!r.ok) {
    throw new ApiError(r.status, json, text);
  }
  return json;
}

export const get = (p) => request('GET', p);
export const create = (p, body) => request('POST', p, body);
export const mergePatch = (p, body) => request('PATCH', p, body, 'application/merge-patch+json');
export const remove = (p, body) => request('DELETE', p, body);

const enc = encodeURIComponent;

// Paths of the kinds the dashboard shows.
export const paths = {
  vms: (ns) => (ns ? `/apis/kubevirt.io/v1/namespaces/${enc(ns)}/virtualmachines` : '/apis/kubevirt.io/v1/virtualmachines'),
  vm: (ns, name) => `${paths.vms(ns)}/${enc(name)}`,
  vmis: (ns) => (ns ? `/apis/kubevirt.io/v1/namespaces/${enc(ns)}/virtualmachineinstances` : '/apis/kubevirt.io/v1/virtualmachineinstances'),
  vmi: (ns, name) => `${paths.vmis(ns)}/${enc(name)}`,
  migrations: (ns) => (ns ? `/apis/kubevirt.io/v1/namespaces/${enc(ns)}/virtualmachineinstancemigrations` : '/apis/kubevirt.io/v1/virtualmachineinstancemigrations'),
  volumes: (ns) => (ns ? `/apis/sheaf.dev/v1/namespaces/${enc(ns)}/volumes` : '/apis/sheaf.dev/v1/volumes'),
  volume: (ns, name) => `${paths.volumes(ns)}/${enc(name)}`,
  nodes: () => '/apis/sheaf.dev/v1/nodes',
  node: (name) => `/apis/sheaf.dev/v1/nodes/${enc(name)}`,
  // Subresources the cluster binary serves (examples/src/server.rs).
  vmVerb: (ns, name, verb) => `/apis/subresources.kubevirt.io/v1/namespaces/${enc(ns)}/virtualmachines/${enc(name)}/${verb}`,
  console: (ns, name) => `/apis/subresources.kubevirt.io/v1/namespaces/${enc(ns)}/virtualmachineinstances/${enc(name)}/console`,
};

// Checks a token: resolves to { write } or throws the ApiError (401 for a
// wrong token). Whether it may write is probed with a dry-run create of an
// empty object: the read-only role is refused (403) before the body is
// read; the admin gets a 400 for the empty body. Nothing is stored.
export async function whoami() {
  await get('/apis/kubevirt.io/v1');
  try {
    await request('POST', `${paths.vms('default')}?dryRun=All`, {});
    return { write: true };
  } catch (e) {
    if (e.status === 403) {
      return { write: false };
    }
    if (e.status === 401) {
      throw e;
    }
    return { write: true };
  }
}
