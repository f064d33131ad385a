// SPDX-License-Identifier: Apache-2.0
// JSON value → YAML text (block style; strings quoted when they would not
// read back as the same string).

const PLAIN = /^[A-Za-z0-9_./][A-Za-z0-9_./ :-]*$/;
const RESERVED = /^(true|false|yes|no|on|off|null|~|-?[0-9.]+(e[0-9]+)?)$/i;

function scalar(v) {
  if (v === null || v === undefined) {
    return 'null';
  }
  if (typeof v === 'number' || typeof v === 'boolean') {
    return String(v);
  }
  const s = String(v);
  if (PLAIN.test(s) && !RESERVED.test(s) && !s.includes(': ') && !s.endsWith(':') && !s.endsWith(' ')) {
    return s;
  }
  return JSON.stringify(s);
}

function isEmpty(v) {
  return (Array.isArray(v) && v.length === 0) || (v && typeof v === 'object' && Object.keys(v).length === 0);
}

function block(s, pad) {
  const keep = s.endsWith('\n') ? '' : '-';
  const body = s.replace(/\n$/, '').split('\n').map((l) => (l ? pad + l : '')).join('\n');
  return `|${keep}\n${body}`;
}

function value(v, indent) {
  const pad = '  '.repeat(indent);
  if (Array.isArray(v)) {
    if (!v.length) {
      return ' []';
    }
    return '\n' + v.map((x) => {
      if (x && typeof x === 'object' && !isEmpty(x)) {
        const inner = value(x, indent + 1).replace(/^\n/, '');
        return `${pad}- ${inner.slice(pad.length + 2)}`;
      }
      return `${pad}-${value(x, indent + 1)}`;
    }).join('\n');
  }
  if (v && typeof v === 'object') {
    const keys = Object.keys(v);
    if (!keys.length) {
      return ' {}';
    }
    return '\n' + keys.map((k) => `${pad}${scalar(k)}:${value(v[k], indent + 1)}`).join('\n');
  }
  if (typeof v === 'string' && v.includes('\n')) {
    return ' ' + block(v, pad);
  }
  return ' ' + scalar(v);
}

export function toYaml(v) {
  return value(v, 0).replace(/^\n/, '') + '\n';
}
