// SPDX-License-Identifier: Apache-2.0
// The dashboard shell: login, navigation, live collections, page routing.

import { clearToken, paths, setToken, token, whoami } from './api.js';
import { Collection, Feed } from './live.js';
import * as overview from './overview.js';
import * as vms from './vms.js';
import * as vmdetail from './vmdetail.js';
import * as create from './create.js';
import * as volumes from './volumes.js';
import * as nodes from './nodes.js';
import * as consolePage from './console.js';

const $ = (id) => document.getElementById(id);

const live = {
  vms: new Collection('VirtualMachine', paths.vms()),
  vmis: new Collection('VirtualMachineInstance', paths.vmis()),
  volumes: new Collection('Volume', paths.volumes()),
  nodes: new Collection('Node', paths.nodes()),
  migrations: new Collection('Migration', paths.migrations()),
};
const feed = new Feed(25);
Object.values(live).forEach((c) => feed.follow(c));

const ctx = {
  live,
  feed,
  write: false,
  status(msg, bad) {
    const s = $('status');
    s.textContent = msg;
    s.className = `status ${bad ? 'bad' : ''}`;
  },
  navigate(hash) {
    location.hash = hash;
  },
};

// Pages by the first part of the hash: #/vms/NS/NAME → vmdetail(NS, NAME).
const routes = {
  overview: (p) => overview.mount(p, ctx),
  vms: (p, ns, name) => (name ? vmdetail.mount(p, ctx, ns, name) : vms.mount(p, ctx)),
  create: (p) => create.mount(p, ctx),
  volumes: (p) => volumes.mount(p, ctx),
  nodes: (p) => nodes.mount(p, ctx),
  console: (p, ns, name) => consolePage.mount(p, ctx, ns, name),
};

let unmount = null;

function route() {
  if (!token()) {
    return;
  }
  const parts = location.hash.replace(/^#\/?/, '').split('/').filter(Boolean).map(decodeURIComponent);
  const name = routes[parts[0]] ? parts[0] : 'overview';
  if (unmount) {
    unmount();
    unmount = null;
  }
  const page = $('page');
  page.replaceChildren();
  page.setAttribute('data-page', name);
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.dataset.page === name) {
      a.setAttribute('aria-current', 'page');
    } else {
      a.removeAttribute('aria-current');
    }
  }
  unmount = routes[name](page, ...parts.slice(1)) || null;
}

function showLogin(message) {
  for (const c of Object.values(live)) {
    c.stop();
  }
  if (unmount) {
    unmount();
    unmount = null;
  }
  $('page').replaceChildren();
  $('nav').hidden = true;
  $('logout').hidden = true;
  $('who').textContent = '';
  $('login').hidden = false;
  const err = $('login-error');
  err.hidden = !message;
  err.textContent = message || '';
  $('token').focus();
}

async function login(t) {
  setToken(t);
  let who;
  try {
    who = await whoami();
  } catch (e) {
    clearToken();
    const why = e.status === 401 ? 'The API server refused this token (401 Unauthorized).' : `Cannot reach the API: ${e.message}`;
    showLogin(why);
    return;
  }
  ctx.write = who.write;
  document.body.classList.toggle('read-only', !who.write);
  $('login').hidden = true;
  $('nav').hidden = false;
  $('logout').hidden = false;
  $('who').textContent = who.write ? 'admin' : 'read-only';
  for (const a of document.querySelectorAll('#nav [data-write]')) {
    a.hidden = !who.write;
  }
  for (const c of Object.values(live)) {
    c.onUnauthorized = () => {
      clearToken();
      showLogin('The API server no longer accepts this token (401 Unauthorized).');
    };
    c.start();
  }
  ctx.status('Connected; following the API watch streams.');
  route();
}

$('login-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const t = $('token').value.trim();
  $('token').value = '';
  if (t) {
    login(t);
  }
});

$('logout').addEventListener('click', () => {
  clearToken();
  ctx.status('');
  showLogin('');
});

window.addEventListener('hashchange', route);

if (token()) {
  login(token());
} else {
  showLogin('');
}
