// SPDX-License-Identifier: Apache-2.0
// Live collections: a list, then the API's watch stream (newline-delimited
// JSON events) from the list's resourceVersion. A 410 Expired relists; a
// dropped stream resumes from the last resourceVersion seen.

import { ApiError, get, headers } from './api.js';

class Expired extends Error {}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export function key(o) {
  const m = o.metadata || {};
  return `${m.namespace || ''}/${m.name || ''}`;
}

export class Collection {
  constructor(kind, path) {
    this.kind = kind;
    this.path = path;
    this.items = new Map();
    this.listeners = new Set();
    this.error = null;
    this.synced = false;
    this.rv = '';
    this.abort = null;
    this.stopped = true;
    this.gen = 0;
    this.onUnauthorized = null;
  }

  on(fn) {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  emit(type, obj) {
    for (const fn of this.listeners) {
      fn(type, obj, this);
    }
  }

  list() {
    return [...this.items.values()].sort((a, b) => key(a).localeCompare(key(b)));
  }

  get(ns, name) {
    return this.items.get(`${ns || ''}/${name}`);
  }

  start() {
    if (!this.stopped) {
      return;
    }
    this.stopped = false;
    this.gen += 1;
    this.run(this.gen);
  }

  stop() {
    this.stopped = true;
    this.gen += 1;
    if (this.abort) {
      this.abort.abort();
    }
    this.items.clear();
    this.synced = false;
  }

  // One loop per start(); a loop whose generation is old ends at its next step.
  async run(gen) {
    let backoff = 500;
    const live = () => !this.stopped && gen === this.gen;
    while (live()) {
      try {
        if (!this.synced) {
          const l = await get(this.path);
          if (!live()) {
            return;
          }
          this.items.clear();
          for (const o of l.items || []) {
            this.items.set(key(o), o);
          }
          this.rv = (l.metadata && l.metadata.resourceVersion) || '';
          this.synced = true;
          this.error = null;
          this.emit('SYNC', null);
        }
        await this.watch(live);
        backoff = 500;
      } catch (e) {
        if (!live()) {
          return;
        }
        if (e instanceof Expired) {
          this.synced = false;
          continue;
        }
        this.error = e;
        this.emit('ERROR', e);
        if (e instanceof ApiError && e.status === 401) {
          this.stopped = true;
          if (this.onUnauthorized) {
            this.onUnauthorized(e);
          }
          return;
        }
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 10000);
      }
    }
  }

  async watch(live) {
    this.abort = new AbortController();
    const sep = this.path.includes('?') ? '&' : '?';
    const url = `${this.path}${sep}watch=1&allowWatchBookmarks=true&resourceVersion=${encodeURIComponent(this.rv)}`;
    const r = await fetch(url, { headers: headers(), credentials: 'omit', cache: 'no-store', signal: this.abort.signal });
    if (!r.ok) {
      const text = await r.text();
      let body = null;
      try {
        body = JSON.parse(text);
      } catch (_) {
        body = null;
      }
      throw new ApiError(r.status, body, text);
    }
    if (this.error) {
      this.error = null;
      this.emit('SYNC', null);
    }
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done || !live()) {
        return;
      }
      buf += value;
      let i;
      while ((i = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 1);
        if (line) {
          this.apply(JSON.parse(line));
        }
      }
    }
  }

  apply(ev) {
    const obj = ev.object || {};
    if (ev.type === 'ERROR') {
      if (obj.code === 410) {
        throw new Expired();
      }
      throw new ApiError(obj.code || 500, obj, '');
    }
    const rv = obj.metadata && obj.metadata.resourceVersion;
    if (rv) {
      this.rv = rv;
    }
    if (ev.type === 'BOOKMARK') {
      return;
    }
    if (ev.type === 'DELETED') {
      this.items.delete(key(obj));
    } else {
      this.items.set(key(obj), obj);
    }
    this.emit(ev.type, obj);
  }
}

// The last changes seen on every collection (the API has no Event kind):
// what the overview shows as recent activity.
export class Feed {
  constructor(max) {
    this.max = max;
    this.entries = [];
    this.listeners = new Set();
  }

  on(fn) {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  follow(c) {
    c.on((type, obj) => {
      if (type === 'SYNC' || type === 'ERROR' || !obj) {
        return;
      }
      this.entries.unshift({ at: new Date(), type, kind: c.kind, key: key(obj) });
      this.entries.length = Math.min(this.entries.length, this.max);
      for (const fn of this.listeners) {
        fn();
      }
    });
  }
}
