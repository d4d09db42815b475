// The outside references for hf_chat_test: the prompt ids a Hugging Face
// stack would feed the model for a chat request (the model's template
// rendered by @huggingface/jinja, then encoded by @huggingface/tokenizers
// without adding special tokens, as transformers' apply_chat_template does),
// and OpenAI's own JavaScript client calling the router.
//
//   node hf_chat_reference.mjs --modules DIR --model-dir DIR --request FILE
//        --base-url URL --api-key KEY --model NAME
// Prints one JSON object: {"ids": [...], "text": "...", "client": {...}}.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith("--")) acc.push([a.slice(2), all[i + 1]]);
    return acc;
  }, []));
const modules = path.resolve(args.modules);
const require = createRequire(path.join(modules, "x.js"));
const { Template } = require("@huggingface/jinja");
const { Tokenizer } = await import(pathToFileURL(
  path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);
const OpenAI = require("openai");

const config = JSON.parse(
  fs.readFileSync(path.join(args["model-dir"], "tokenizer_config.json")));
const tokenizerJson = JSON.parse(
  fs.readFileSync(path.join(args["model-dir"], "tokenizer.json")));
const request = JSON.parse(fs.readFileSync(args.request));

const special = (t) => (t && typeof t === "object" ? t.content : t) ?? "";
const context = {
  ...(request.chat_template_kwargs ?? {}),
  messages: request.messages,
  add_generation_prompt: true,
  bos_token: special(config.bos_token),
  eos_token: special(config.eos_token),
};
if (request.tools) context.tools = request.tools;
const text = new Template(config.chat_template).render(context);
const tok = new Tokenizer(tokenizerJson, config);
const ids = tok.encode(text, { add_special_tokens: false }).ids;

const client = new OpenAI({ baseURL: args["base-url"], apiKey: args["api-key"] });
const completion = await client.chat.completions.create({
  model: args.model,
  messages: request.messages,
  tools: request.tools,
  max_tokens: 6,
  temperature: 0,
  chat_template_kwargs: request.chat_template_kwargs,
});
const stream = await client.chat.completions.create({
  model: args.model,
  messages: request.messages,
  max_tokens: 6,
  temperature: 0,
  stream: true,
  stream_options: { include_usage: true },
  chat_template_kwargs: request.chat_template_kwargs,
});
let streamed = "";
let usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) streamed += c.delta?.content ?? "";
}
let models = await client.models.retrieve(args.model);
// Sampling controls: a +100 bias makes one token the greedy choice at every
// step (through the penalties, which only lower its lead), best_of 2 bills
// both candidates.
const forced = tok.encode(" Paris", { add_special_tokens: false }).ids[0];
const penalized = await client.completions.create({
  model: args.model,
  prompt: "The capital of France is",
  max_tokens: 5,
  temperature: 0,
  logit_bias: { [forced]: 100 },
  frequency_penalty: 0.5,
  presence_penalty: 0.5,
  repetition_penalty: 1.1,
  min_p: 0.05,
  min_tokens: 5,
  best_of: 2,
  seed: 3,
});
// Structured output: OpenAI's json_schema response format (strict), and
// vLLM's guided_choice as an extra body field.
const structured = await client.chat.completions.create({
  model: args.model,
  messages: [{ role: "user", content: "Describe a city as JSON." }],
  max_tokens: 600,
  temperature: 1,
  seed: 11,
  chat_template_kwargs: { enable_thinking: false },
  response_format: {
    type: "json_schema",
    json_schema: {
      name: "city",
      strict: true,
      schema: {
        type: "object",
        properties: {
          name: { type: "string", maxLength: 12 },
          population: { type: "integer" },
          capital: { type: "boolean" },
        },
        required: ["name", "population", "capital"],
        additionalProperties: false,
      },
    },
  },
});
const choice = await client.chat.completions.create({
  model: args.model,
  messages: [{ role: "user", content: "Yes or no?" }],
  max_tokens: 10,
  chat_template_kwargs: { enable_thinking: false },
  guided_choice: ["yes", "no"],
});
console.log(JSON.stringify({
  ids, text,
  client: {
    finish_reason: completion.choices[0].finish_reason,
    message: completion.choices[0].message,
    prompt_tokens: completion.usage.prompt_tokens,
    streamed, streamed_prompt_tokens: usage?.prompt_tokens ?? -1,
    model_id: models.id,
    forced_token: forced,
    forced_text: tok.decode(Array(5).fill(forced)),
    penalized_text: penalized.choices[0].text,
    penalized_completion_tokens: penalized.usage.completion_tokens,
    structured: structured.choices[0].message.content,
    structured_finish: structured.choices[0].finish_reason,
    choice: choice.choices[0].message.content,
  },
}));
