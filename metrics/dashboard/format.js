// Numbers for people, as the dashboard shows them: 28.8k, 1.2M, 3.4 ms, 97.8%, 1.5 MiB.
// Never exponent notation (no `2.878e+4`): values beyond the prefixes get more digits.
// A plain script: in the page it defines window.rackrunFormat (loaded before
// dashboard.js); under Node it is a CommonJS module (tests/node/dashboard_format.test.js).
'use strict';

(function (root) {
  // Three significant digits, trailing zeros dropped, never exponent notation:
  // 0.5, 12.3, 123, 1.23. Values below 1e-3 keep three significant digits (0.000123).
  function digits(v, sig = 3) {
    if (!Number.isFinite(v)) return '–';
    if (v === 0) return '0';
    const a = Math.abs(v);
    if (a >= 1e21) return BigInt(Math.round(v)).toString();  // toFixed would write 1e+21
    const places = Math.max(0, sig - 1 - Math.floor(Math.log10(a)));
    let s = v.toFixed(Math.min(places, 20));
    if (s.includes('.')) s = s.replace(/0+$/, '').replace(/\.$/, '');
    return s === '-0' ? '0' : s;
  }

  // Counts and rates: 950, 28.8k, 1.2M, 3.4G, 5.6T (SI: k = 1e3). Below 1000 as digits().
  function count(v) {
    if (!Number.isFinite(v)) return '–';
    const a = Math.abs(v);
    const units = [[1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']];
    for (const [scale, unit] of units) {
      // Rounding to 3 digits can carry into the next unit (999.96k -> 1M).
      if (a >= scale * 0.9995) {
        const scaled = v / scale;
        if (unit !== 'T' && Math.abs(scaled) >= 999.5) continue;
        return digits(scaled) + unit;
      }
    }
    return digits(v);
  }

  // Seconds: 1.2 µs, 3.4 ms, 12.3 s, 4 min 5 s, 2 h 3 min.
  function seconds(v) {
    if (!Number.isFinite(v)) return '–';
    const a = Math.abs(v);
    if (a === 0) return '0 s';
    if (a < 1e-6) return `${digits(v * 1e9)} ns`;
    if (a < 1e-3) return `${digits(v * 1e6)} µs`;
    if (a < 0.9995) return `${digits(v * 1e3)} ms`;
    if (a < 59.95) return `${digits(v)} s`;
    const sign = v < 0 ? '-' : '';
    const total = Math.round(a);
    if (total < 3600) return `${sign}${Math.floor(total / 60)} min ${total % 60} s`;
    return `${sign}${Math.floor(total / 3600)} h ${Math.floor((total % 3600) / 60)} min`;
  }

  // A 0-1 ratio as a percentage: 97.8%, 100%, 0.5%.
  function percent(v) {
    if (!Number.isFinite(v)) return '–';
    return `${digits(v * 100)}%`;
  }

  // Bytes in binary units: 512 B, 1.5 KiB, 3.2 MiB, 1.1 GiB.
  function bytes(v) {
    if (!Number.isFinite(v)) return '–';
    const a = Math.abs(v);
    const units = [[2 ** 40, 'TiB'], [2 ** 30, 'GiB'], [2 ** 20, 'MiB'], [2 ** 10, 'KiB']];
    for (const [scale, unit] of units) {
      if (a >= scale * 0.9995 && (unit === 'TiB' || Math.abs(v / scale) < 1023.5)) return `${digits(v / scale)} ${unit}`;
    }
    return `${digits(v)} B`;
  }

  // A factor such as imbalance (max/mean): 1.85×, 1.02×.
  function factor(v) {
    if (!Number.isFinite(v)) return '–';
    return `${Math.abs(v) < 1e3 ? v.toFixed(2) : digits(v)}×`;
  }

  // A loss: four significant digits (4.123, 0.8125), no exponent.
  function loss(v) {
    return digits(v, 4);
  }

  const api = { digits, count, seconds, percent, bytes, factor, loss };
  if (typeof module === 'object' && module.exports) module.exports = api;
  else root.rackrunFormat = api;
})(typeof window !== 'undefined' ? window : globalThis);
