// Checks grammar-constrained outputs with checkers independent of
// services/grammar: JSON.parse + ajv (draft 2020-12) for JSON schemas and
// json_object (ajv-formats for `format`), JavaScript RegExp (u flag, anchored) for regexes, string
// equality for choices.
//
//   node tests/grammar/validate_outputs.cjs --modules DIR/node_modules --in FILE
// FILE: {"cases": <validation_cases.json>, "outputs": [{"kind": "json_schema"|
// "json_object"|"regex"|"choice", "index": N, "text": "..."}]}. Prints one
// JSON object: {"checked": N, "failures": [{"i", "kind", "index", "text",
// "why"}]}.
'use strict';
const fs = require('fs');
const path = require('path');

const args = process.argv.slice(2);
const arg = (name) => {
  const i = args.indexOf(name);
  if (i < 0 || i + 1 >= args.length) throw new Error(`missing ${name}`);
  return args[i + 1];
};
const modules = arg('--modules');
const input = JSON.parse(fs.readFileSync(arg('--in'), 'utf8'));
const Ajv2020 = require(path.join(modules, 'ajv/dist/2020')).default;
const addFormats = require(path.join(modules, 'ajv-formats')).default;
const ajv = new Ajv2020({strict: false, allErrors: true});
addFormats(ajv);  // "full" mode: dates checked against the calendar
const validators = input.cases.json_schemas.map((c) => ajv.compile(c.schema));

const failures = [];
input.outputs.forEach((o, i) => {
  const fail = (why) => failures.push({i, kind: o.kind, index: o.index, text: o.text, why});
  if (o.kind === 'json_schema' || o.kind === 'json_object') {
    let value;
    try {
      value = JSON.parse(o.text);
    } catch (e) {
      return fail(`JSON.parse: ${e.message}`);
    }
    if (o.kind === 'json_object') {
      if (value === null || typeof value !== 'object' || Array.isArray(value)) {
        fail('not a JSON object');
      }
      return;
    }
    const validate = validators[o.index];
    if (!validate(value)) fail(ajv.errorsText(validate.errors));
  } else if (o.kind === 'regex') {
    const pattern = input.cases.regexes[o.index];
    if (!new RegExp(`^(?:${pattern})$`, 'u').test(o.text)) fail(`no full match of /${pattern}/u`);
  } else if (o.kind === 'choice') {
    if (!input.cases.choices[o.index].includes(o.text)) fail('not one of the choices');
  } else {
    fail(`unknown kind ${o.kind}`);
  }
});
process.stdout.write(JSON.stringify({checked: input.outputs.length, failures}) + '\n');
