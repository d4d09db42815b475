// llama.cpp's side of bench/quant_vs_llamacpp.sh, through node-llama-cpp's
// prebuilt binaries (CPU only): a PROMPT-token prefill and batch-1 greedy
// decode of DECODE tokens on THREADS threads, best of REPEATS.
//
//   node bench/llamacpp_bench.mjs MODEL.gguf [THREADS] [PROMPT] [DECODE] [REPEATS]
//
// Run with NODE_PATH=<dir>/node_modules (the script's installer puts
// node-llama-cpp under build/llamacpp). Prints one JSON line like quant_bench.
import path from "node:path";
import { pathToFileURL } from "node:url";

const modules = path.resolve(process.env.NODE_PATH ?? "node_modules");
const { getLlama } = await import(
  pathToFileURL(path.join(modules, "node-llama-cpp/dist/index.js")).href);

const [modelPath, threadsArg = "2", promptArg = "512", decodeArg = "64",
       repeatsArg = "3"] = process.argv.slice(2);
const threads = Number(threadsArg);
const promptLen = Number(promptArg);
const decodeSteps = Number(decodeArg);
const repeats = Number(repeatsArg);

const llama = await getLlama({
  gpu: false, build: "never", skipDownload: true, maxThreads: threads,
  logLevel: "error",
});
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const context = await model.createContext({
  contextSize: 2048, batchSize: promptLen, sequences: 1,
  threads: { ideal: threads, min: threads },
});
const sequence = context.getSequence();

// Ids past the byte tokens, the same pseudo-random walk for every file.
let state = 5;
const prompt = [];
for (let i = 0; i < promptLen; ++i) {
  state = (state * 48271) % 2147483647;
  prompt.push(259 + (state % 31000));
}

let bestPrefill = 0, bestDecode = 0;
for (let rep = 0; rep < repeats; ++rep) {
  await sequence.clearHistory();
  let start = performance.now();
  await sequence.evaluateWithoutGeneratingNewTokens(prompt);
  bestPrefill = Math.max(bestPrefill, promptLen / ((performance.now() - start) / 1000));
  // One decode step per call: evaluate the last token, greedy-pick the next.
  const last = prompt[prompt.length - 1];
  await sequence.eraseContextTokenRanges([{ start: promptLen - 1, end: promptLen }]);
  let next = last;
  const step = async () => {
    const out = await sequence.controlledEvaluate(
      [[next, { generateNext: { token: true, options: { temperature: 0 } } }]]);
    next = out[0].next.token;
  };
  await step();  // the prompt's last token: not a timed decode step
  start = performance.now();
  for (let i = 0; i < decodeSteps; ++i) await step();
  bestDecode = Math.max(bestDecode, decodeSteps / ((performance.now() - start) / 1000));
}
console.log(JSON.stringify({
  engine: "llama.cpp", model: modelPath, threads,
  prefill_tok_s: Number(bestPrefill.toFixed(1)),
  decode_tok_s: Number(bestDecode.toFixed(1)),
}));
await context.dispose();
await model.dispose();
await llama.dispose();
