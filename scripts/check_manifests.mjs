// Renders Kustomize overlays offline and validates every object against the
// Kubernetes (and Prometheus Operator) schemas of the npm kubernetes-models
// packages, plus pdserve's own rules (probes, metrics, layout consistency).
//
//   node scripts/check_manifests.mjs --modules DIR [--out DIR]
//        [--compare-kubectl] OVERLAY...
//
// DIR holds node_modules (scripts/setup_deploy_checks.sh). With --out, each
// overlay's rendering is written there as <overlay>.json (a list of
// objects) for tests that start the processes the manifests describe.
// The renderer supports the subset of Kustomize the manifests use:
// resources (files, kustomization folders), namespace, images,
// configMapGenerator (files; generatorOptions labels, no name hash) and
// patches holding JSON 6902 operations with a kind/name target. Anything
// else in a kustomization.yaml is an error, so the subset cannot drift.
// --compare-kubectl also renders with `kubectl kustomize` where kubectl is
// installed and requires the same objects (it says so when it is not).
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const args = process.argv.slice(2);
let modules = "", out = "", compare = false;
const overlays = [];
for (let i = 0; i < args.length; ++i) {
  if (args[i] === "--modules") modules = args[++i];
  else if (args[i] === "--compare-kubectl") compare = true;
  else if (args[i] === "--out") out = args[++i];
  else overlays.push(args[i]);
}
if (!modules || overlays.length === 0) {
  console.error("usage: check_manifests.mjs --modules DIR [--out DIR] OVERLAY...");
  process.exit(2);
}
const nm = path.resolve(modules, "node_modules");
const load = (p) => import(pathToFileURL(path.join(nm, p)).href);
const yaml = (await load("js-yaml/dist/js-yaml.mjs")).default;
const jsonpatch = (await load("fast-json-patch/index.mjs")).default;

const errors = [];
const fail = (where, msg) => errors.push(`${where}: ${msg}`);

// ---- Rendering ---------------------------------------------------------------

const KNOWN = new Set(["apiVersion", "kind", "resources", "namespace", "images",
  "configMapGenerator", "generatorOptions", "patches"]);

function build(dir) {
  const kfile = path.join(dir, "kustomization.yaml");
  const k = yaml.load(fs.readFileSync(kfile, "utf8"));
  for (const key of Object.keys(k)) {
    if (!KNOWN.has(key)) throw new Error(`${kfile}: unsupported field ${key}`);
  }
  let objects = [];
  for (const r of k.resources ?? []) {
    const p = path.join(dir, r);
    if (fs.statSync(p).isDirectory()) objects.push(...build(p));
    else objects.push(...yaml.loadAll(fs.readFileSync(p, "utf8")).filter(Boolean));
  }
  const gen = k.generatorOptions ?? {};
  if (gen.disableNameSuffixHash !== undefined && gen.disableNameSuffixHash !== true)
    throw new Error(`${kfile}: only disableNameSuffixHash: true is supported`);
  for (const g of k.configMapGenerator ?? []) {
    if (!gen.disableNameSuffixHash)
      throw new Error(`${kfile}: configMapGenerator needs disableNameSuffixHash`);
    const data = {};
    for (const f of g.files ?? []) data[path.basename(f)] = fs.readFileSync(path.join(dir, f), "utf8");
    objects.push({ apiVersion: "v1", kind: "ConfigMap",
      metadata: { name: g.name, ...(gen.labels ? { labels: { ...gen.labels } } : {}) }, data });
  }
  for (const p of k.patches ?? []) {
    const ops = yaml.load(fs.readFileSync(path.join(dir, p.path), "utf8"));
    if (!Array.isArray(ops)) throw new Error(`${p.path}: only JSON 6902 patches are supported`);
    const targets = objects.filter((o) => o.kind === p.target.kind && o.metadata.name === p.target.name);
    if (targets.length !== 1) throw new Error(`${kfile}: patch ${p.path} matches ${targets.length} objects`);
    const i = objects.indexOf(targets[0]);
    objects[i] = jsonpatch.applyPatch(structuredClone(targets[0]), ops, true).newDocument;
  }
  if (k.namespace) {
    for (const o of objects) {
      if (o.kind === "Namespace") continue;
      o.metadata.namespace = k.namespace;
    }
  }
  for (const img of k.images ?? []) {
    for (const o of objects) {
      const spec = o.spec?.template?.spec;
      if (!spec) continue;
      for (const c of [...(spec.containers ?? []), ...(spec.initContainers ?? [])]) {
        const [name, tag] = c.image.split(":");
        if (name !== img.name) continue;
        c.image = `${img.newName ?? name}:${img.newTag ?? tag ?? "latest"}`;
      }
    }
  }
  return objects;
}

// ---- Schema validation ------------------------------------------------------

async function validate(o, where) {
  const [group, version] = o.apiVersion.includes("/") ? o.apiVersion.split("/") : ["", o.apiVersion];
  const file = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${o.kind}.js`
    : `kubernetes-models/${group ? group + "/" : ""}${version}/${o.kind}.js`;
  let mod;
  try {
    mod = await load(file);
  } catch (e) {
    fail(where, `no schema for ${o.apiVersion} ${o.kind}`);
    return;
  }
  try {
    new mod[o.kind](o).validate();
  } catch (e) {
    fail(where, `schema: ${e.message}`);
  }
}

// ---- pdserve's rules --------------------------------------------------------

const BINARIES = new Set(["/opt/pdserve/bin/router", "/opt/pdserve/bin/decode_worker",
  "/opt/pdserve/bin/prefill-stage"]);

function checkPdserve(objects, overlay) {
  const layout = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === "pdserve-layout");
  if (!layout) return fail(overlay, "no pdserve-layout ConfigMap");
  const dash = objects.find((o) => o.kind === "ConfigMap" && o.metadata.labels?.grafana_dashboard === "1");
  if (!dash || Object.keys(dash.data).length < 4) fail(overlay, "dashboards ConfigMap missing or incomplete");
  for (const [name, json] of Object.entries(dash?.data ?? {})) {
    try { JSON.parse(json); } catch (e) { fail(overlay, `dashboard ${name}: ${e.message}`); }
  }
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet"].includes(o.kind));
  if (workloads.length < 3) fail(overlay, "expected router, prefill and decode workloads");
  for (const w of workloads) {
    const where = `${overlay} ${w.kind}/${w.metadata.name}`;
    const pod = w.spec.template;
    const ann = pod.metadata.annotations ?? {};
    if (ann["prometheus.io/scrape"] !== "true" || ann["prometheus.io/port"] !== "9100")
      fail(where, "pod lacks prometheus.io annotations for port 9100");
    if (pod.metadata.labels?.["app.kubernetes.io/part-of"] !== "pdserve")
      fail(where, "pod is not labelled part-of pdserve (PodMonitor selects it)");
    const c = pod.spec.containers[0];
    if (!BINARIES.has(c.command?.[0])) fail(where, `command ${c.command} is not an installed binary`);
    const ports = new Map((c.ports ?? []).map((p) => [p.name, p.containerPort]));
    if (ports.get("metrics") !== 9100) fail(where, "no container port named metrics = 9100");
    if (!c.args.includes("--metrics-port=9100")) fail(where, "args lack --metrics-port=9100");
    for (const probe of ["readinessProbe", "livenessProbe"]) {
      const g = c[probe]?.grpc;
      if (!g || g.port !== ports.get("grpc")) fail(where, `${probe} is not a gRPC probe on the grpc port`);
    }
    if (!c.resources?.requests?.cpu || !c.resources?.requests?.memory) fail(where, "no cpu/memory requests");
    const env = new Set([...Object.keys(layout.data), ...(c.env ?? []).map((e) => e.name)]);
    if (!(c.envFrom ?? []).some((e) => e.configMapRef?.name === "pdserve-layout"))
      fail(where, "does not read the layout ConfigMap");
    for (const a of c.args) {
      for (const m of a.matchAll(/\$\(([A-Z_0-9]+)\)/g)) {
        if (!env.has(m[1])) fail(where, `arg ${a} uses undefined $(${m[1]})`);
      }
    }
    const mounts = new Set((c.volumeMounts ?? []).map((m) => m.name));
    for (const v of pod.spec.volumes ?? []) {
      if (!mounts.has(v.name)) fail(where, `volume ${v.name} is not mounted`);
    }
    if (!layout.data.MODEL_PATH.startsWith("/models/")) fail(where, "MODEL_PATH is not under /models");
    // Nobody unauthenticated gets in: every process takes the cluster's
    // internal token, the router its API keys, both from the Secret.
    const secretPaths = new Map();
    for (const v of pod.spec.volumes ?? []) {
      if (v.secret?.secretName !== "pdserve-auth") continue;
      const m = (c.volumeMounts ?? []).find((vm) => vm.name === v.name);
      if (!m) continue;
      for (const item of v.secret.items ?? []) secretPaths.set(item.key, `${m.mountPath}/${item.path}`);
    }
    const wants = [["--internal-token-file", "internal-token"]];
    if (c.command?.[0] === "/opt/pdserve/bin/router") wants.push(["--api-key-file", "api-keys"]);
    for (const [flag, key] of wants) {
      const arg = c.args.find((a) => a.startsWith(`${flag}=`));
      if (!arg) fail(where, `args lack ${flag}`);
      else if (arg.slice(flag.length + 1) !== secretPaths.get(key))
        fail(where, `${flag} is not the pdserve-auth Secret's ${key} (mounted: ${secretPaths.get(key)})`);
    }
    if (pod.spec.securityContext?.fsGroup === undefined)
      fail(where, "no fsGroup: the image's non-root user cannot read the Secret");
  }
  const sts = objects.find((o) => o.kind === "StatefulSet" && o.metadata.name === "prefill");
  if (!sts) return fail(overlay, "no prefill StatefulSet");
  if (String(sts.spec.replicas) !== layout.data.PREFILL_STAGES)
    fail(overlay, `prefill replicas ${sts.spec.replicas} != PREFILL_STAGES ${layout.data.PREFILL_STAGES}`);
  const headless = objects.find((o) => o.kind === "Service" && o.metadata.name === sts.spec.serviceName);
  if (!headless || headless.spec.clusterIP !== "None" || !headless.spec.publishNotReadyAddresses)
    fail(overlay, "prefill needs a headless Service publishing not-ready addresses");
  const decode = workloads.filter((w) => w.spec.template.metadata.labels["pdserve.io/role"] === "decode");
  for (const d of decode) {
    const gpus = d.spec.template.spec.containers[0].resources?.limits?.["nvidia.com/gpu"];
    if (gpus !== undefined && String(gpus) !== layout.data.DECODE_TP)
      fail(overlay, `${d.metadata.name}: nvidia.com/gpu ${gpus} != DECODE_TP ${layout.data.DECODE_TP}`);
  }
  // GPUs and the backend go together: a GPU pod running the CPU backend
  // wastes its GPUs, a cuda pod without one fails at start.
  const backend = layout.data.BACKEND;
  if (backend !== "cpu" && backend !== "cuda")
    return fail(overlay, `BACKEND ${backend} is neither cpu nor cuda`);
  for (const w of [...decode, sts]) {
    const gpus = w.spec.template.spec.containers[0].resources?.limits?.["nvidia.com/gpu"];
    if (backend === "cuda" && gpus === undefined)
      fail(overlay, `${w.metadata.name}: BACKEND cuda but no nvidia.com/gpu limit`);
    if (backend === "cpu" && gpus !== undefined)
      fail(overlay, `${w.metadata.name}: requests nvidia.com/gpu but BACKEND is cpu`);
  }
  // Every worker reads the same KV_DTYPE, so prefill and decode agree; it
  // must be one the backend keeps.
  const kvDtype = layout.data.KV_DTYPE;
  const kept = backend === "cuda" ? ["auto", "bf16"] : ["auto", "f32", "bf16"];
  if (!kept.includes(kvDtype))
    fail(overlay, `KV_DTYPE ${kvDtype} is not one the ${backend} backend keeps (${kept.join(", ")})`);
  const devices = String(layout.data.DECODE_CUDA_DEVICES ?? "").split(",");
  if (!devices.every((d) => /^[0-9]+$/.test(d)))
    fail(overlay, `DECODE_CUDA_DEVICES ${layout.data.DECODE_CUDA_DEVICES} is not a list of device ids`);
  if (backend === "cuda" && devices.some((d) => Number(d) >= Number(layout.data.DECODE_TP)))
    fail(overlay, `DECODE_CUDA_DEVICES ${layout.data.DECODE_CUDA_DEVICES} names a GPU the decode pod does not get (${layout.data.DECODE_TP})`);
}

// Same objects as kubectl kustomize renders (order aside).
function compareWithKubectl(objects, overlay) {
  let text;
  try {
    text = execFileSync("kubectl", ["kustomize", overlay], { encoding: "utf8",
      stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    if (e.code === "ENOENT") {
      console.log(`${overlay}: kubectl not installed, rendering not cross-checked`);
      return;
    }
    return fail(overlay, `kubectl kustomize: ${e.stderr || e.message}`);
  }
  const canon = (o) => JSON.stringify(o, (k, v) =>
    v && typeof v === "object" && !Array.isArray(v)
      ? Object.fromEntries(Object.entries(v).sort(([a], [b]) => a.localeCompare(b))) : v);
  const key = (o) => `${o.kind}/${o.metadata.name}`;
  const theirs = new Map(yaml.loadAll(text).filter(Boolean).map((o) => [key(o), canon(o)]));
  const ours = new Map(objects.map((o) => [key(o), canon(o)]));
  for (const [k, v] of ours) {
    if (!theirs.has(k)) fail(overlay, `kubectl kustomize has no ${k}`);
    else if (theirs.get(k) !== v) fail(overlay, `${k} renders differently from kubectl kustomize`);
  }
  for (const k of theirs.keys()) if (!ours.has(k)) fail(overlay, `renderer lacks ${k}`);
  if (!errors.length) console.log(`${overlay}: same ${ours.size} objects as kubectl kustomize`);
}

for (const overlay of overlays) {
  let objects;
  try {
    objects = build(overlay);
  } catch (e) {
    fail(overlay, e.message);
    continue;
  }
  for (const o of objects) await validate(o, `${overlay} ${o.kind}/${o.metadata?.name}`);
  checkPdserve(objects, overlay);
  if (compare) compareWithKubectl(objects, overlay);
  if (out) {
    fs.mkdirSync(out, { recursive: true });
    fs.writeFileSync(path.join(out, `${path.basename(overlay)}.json`), JSON.stringify(objects, null, 1));
  }
  console.log(`${overlay}: ${objects.length} objects (${objects.map((o) => o.kind).join(", ")})`);
}
if (errors.length) {
  for (const e of errors) console.error(`ERROR ${e}`);
  process.exit(1);
}
console.log("manifests valid");
