// The dashboard's number formatting (metrics/dashboard/format.js), the same file the page
// loads: counts, seconds, percentages, bytes and factors for people, never exponents.
'use strict';
const test = require('node:test');
const assert = require('node:assert');
const path = require('node:path');

const format = require(path.join(__dirname, '..', '..', 'metrics', 'dashboard', 'format.js'));

test('counts and rates take SI prefixes with three significant digits', () => {
  assert.strictEqual(format.count(28781), '28.8k');
  assert.strictEqual(format.count(1.2e6), '1.2M');
  assert.strictEqual(format.count(3.4e9), '3.4G');
  assert.strictEqual(format.count(950), '950');
  assert.strictEqual(format.count(12.345), '12.3');
  assert.strictEqual(format.count(0), '0');
  assert.strictEqual(format.count(-4500), '-4.5k');
  // Rounding carries into the next prefix instead of printing 1000k.
  assert.strictEqual(format.count(999960), '1M');
  assert.strictEqual(format.count(999.6), '1k');
  assert.strictEqual(format.count(999.4), '999');
});

test('seconds take the unit that reads best', () => {
  assert.strictEqual(format.seconds(0.0034), '3.4 ms');
  assert.strictEqual(format.seconds(2.5e-5), '25 µs');
  assert.strictEqual(format.seconds(4e-8), '40 ns');
  assert.strictEqual(format.seconds(0.25), '250 ms');
  assert.strictEqual(format.seconds(12.34), '12.3 s');
  assert.strictEqual(format.seconds(245), '4 min 5 s');
  assert.strictEqual(format.seconds(7380), '2 h 3 min');
  assert.strictEqual(format.seconds(0), '0 s');
});

test('ratios, bytes, factors and losses', () => {
  assert.strictEqual(format.percent(0.978), '97.8%');
  assert.strictEqual(format.percent(1), '100%');
  assert.strictEqual(format.percent(0.005), '0.5%');
  assert.strictEqual(format.bytes(512), '512 B');
  assert.strictEqual(format.bytes(1536), '1.5 KiB');
  assert.strictEqual(format.bytes(3.5 * 2 ** 20), '3.5 MiB');
  assert.strictEqual(format.factor(1.8534), '1.85×');
  assert.strictEqual(format.loss(4.123456), '4.123');
  assert.strictEqual(format.loss(0.000123456), '0.0001235');
});

test('no value is ever written with an exponent', () => {
  const values = [2.878e4, 1e-9, 3e-7, 1.5e12, 7.77e15, 123456789, 0.000001234, 1e21];
  for (const v of values) {
    for (const name of ['digits', 'count', 'seconds', 'percent', 'bytes', 'factor', 'loss']) {
      const text = format[name](v);
      assert.ok(!/e[+-]?\d/i.test(text), `${name}(${v}) = ${text}`);
    }
  }
  for (const name of ['count', 'seconds', 'percent', 'bytes']) {
    assert.strictEqual(format[name](NaN), '–');
    assert.strictEqual(format[name](Infinity), '–');
  }
});
