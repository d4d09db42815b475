// Renders Kustomize overlays offline and validates every object against the
// Kubernetes, Prometheus Operator and KEDA schemas of the npm
// kubernetes-models packages (generated from the upstream OpenAPI and CRD
// schemas), plus pdserve's own rules (probes, metrics, layout consistency,
// drain and disruption budgets, autoscaling targets).
// LeaderWorkerSet has no such package: its pod templates are validated as
// core/v1 PodTemplateSpecs (kubernetes-models) and its own fields against
// the published leaderworkerset.x-k8s.io/v1 API reference (LWS_SPEC below).
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
  // As Kustomize's image transformer: every containers / initContainers
  // list at any depth (a LeaderWorkerSet's templates too).
  const containerLists = (value, out = []) => {
    if (Array.isArray(value)) {
      for (const v of value) containerLists(v, out);
    } else if (value && typeof value === "object") {
      for (const [key, v] of Object.entries(value)) {
        if ((key === "containers" || key === "initContainers") && Array.isArray(v)) out.push(v);
        containerLists(v, out);
      }
    }
    return out;
  };
  for (const img of k.images ?? []) {
    for (const o of objects) {
      for (const list of containerLists(o)) {
        for (const c of list) {
          if (typeof c.image !== "string") continue;
          const [name, tag] = c.image.split(":");
          if (name !== img.name) continue;
          c.image = `${img.newName ?? name}:${img.newTag ?? tag ?? "latest"}`;
        }
      }
    }
  }
  return objects;
}

// ---- Schema validation ------------------------------------------------------

// leaderworkerset.x-k8s.io/v1 LeaderWorkerSet, from its API reference
// (kubernetes-sigs/lws site/content/en/docs/reference/leaderworkerset.v1.md):
// field -> [type, required, allowed values]. Nested objects are their own
// entries; unknown fields are errors, as the CRD's structural schema prunes
// or rejects them.
const LWS_SPEC = {
  "spec": ["object", true],
  "spec.replicas": ["integer", false],
  "spec.startupPolicy": ["string", false, ["LeaderCreated", "LeaderReady"]],
  "spec.groupIdentity": ["string", false, ["Ordinal", "Hash"]],
  "spec.networkConfig": ["object", false],
  "spec.networkConfig.subdomainPolicy": ["string", true, ["Shared", "UniquePerReplica"]],
  "spec.rolloutStrategy": ["object", false],
  "spec.rolloutStrategy.type": ["string", true, ["RollingUpdate"]],
  "spec.rolloutStrategy.rollingUpdateConfiguration": ["object", false],
  "spec.rolloutStrategy.rollingUpdateConfiguration.partition": ["integer", false],
  "spec.rolloutStrategy.rollingUpdateConfiguration.maxUnavailable": ["int-or-string", true],
  "spec.rolloutStrategy.rollingUpdateConfiguration.maxSurge": ["int-or-string", true],
  "spec.leaderWorkerTemplate": ["object", true],
  "spec.leaderWorkerTemplate.size": ["integer", false],
  "spec.leaderWorkerTemplate.restartPolicy": ["string", false,
    ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"]],
  "spec.leaderWorkerTemplate.leaderTemplate": ["podtemplate", false],
  "spec.leaderWorkerTemplate.workerTemplate": ["podtemplate", true],
  "spec.leaderWorkerTemplate.subGroupPolicy": ["object", false],
  "spec.leaderWorkerTemplate.subGroupPolicy.subGroupPolicyType": ["string", false],
  "spec.leaderWorkerTemplate.subGroupPolicy.subGroupSize": ["integer", true],
  "spec.leaderWorkerTemplate.volumeClaimTemplates": ["array", false],
  "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy": ["object", false],
};

async function validateLeaderWorkerSet(o, where) {
  const typeOk = (type, v) => {
    switch (type) {
      case "object": return v !== null && typeof v === "object" && !Array.isArray(v);
      case "podtemplate": return v !== null && typeof v === "object";
      case "array": return Array.isArray(v);
      case "integer": return Number.isInteger(v);
      case "string": return typeof v === "string";
      case "int-or-string": return Number.isInteger(v) || (typeof v === "string" && /^[0-9]+%?$/.test(v));
    }
    return false;
  };
  const walk = (value, prefix) => {
    for (const [k, v] of Object.entries(value)) {
      const key = prefix ? `${prefix}.${k}` : k;
      const rule = LWS_SPEC[key];
      if (!rule) {
        fail(where, `schema: LeaderWorkerSet has no field ${key}`);
        continue;
      }
      const [type, , allowed] = rule;
      if (!typeOk(type, v)) fail(where, `schema: ${key} must be ${type}`);
      else if (allowed && !allowed.includes(v)) fail(where, `schema: ${key} must be one of ${allowed.join(", ")}`);
      else if (type === "object") walk(v, key);
    }
  };
  walk({ spec: o.spec }, "");
  // A required field is missing where its parent object is present.
  const get = (path) => path.split(".").reduce((v, k) => (v == null ? undefined : v[k]), o);
  for (const [key, [, required]] of Object.entries(LWS_SPEC)) {
    if (!required) continue;
    const parent = key.includes(".") ? get(key.slice(0, key.lastIndexOf("."))) : o;
    if (parent !== undefined && get(key) === undefined) fail(where, `schema: ${key} is required`);
  }
  const size = o.spec?.leaderWorkerTemplate?.size;
  if (size !== undefined && size < 1) fail(where, "schema: leaderWorkerTemplate.size must be >= 1");
  const { PodTemplate } = await load("kubernetes-models/v1/PodTemplate.js");
  for (const t of ["leaderTemplate", "workerTemplate"]) {
    const template = o.spec?.leaderWorkerTemplate?.[t];
    if (template === undefined) continue;
    try {
      new PodTemplate({ metadata: { name: `${o.metadata.name}-${t}` }, template }).validate();
    } catch (e) {
      fail(where, `schema: ${t}: ${e.message}`);
    }
  }
}

async function validate(o, where) {
  const [group, version] = o.apiVersion.includes("/") ? o.apiVersion.split("/") : ["", o.apiVersion];
  if (group === "leaderworkerset.x-k8s.io" && version === "v1" && o.kind === "LeaderWorkerSet") {
    return validateLeaderWorkerSet(o, where);
  }
  const file = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${o.kind}.js`
    : group === "keda.sh"
    ? `@kubernetes-models/keda/${group}/${version}/${o.kind}.js`
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

// The pod template of a workload (a LeaderWorkerSet's is its worker
// template, which its leader takes too when it has none of its own).
function podTemplate(w) {
  if (w.kind === "LeaderWorkerSet") {
    return w.spec.leaderWorkerTemplate.leaderTemplate ?? w.spec.leaderWorkerTemplate.workerTemplate;
  }
  return w.spec.template;
}

// The labels a workload's pods carry (the LeaderWorkerSet's controller adds
// its own).
function podLabels(w) {
  const labels = { ...(podTemplate(w).metadata?.labels ?? {}) };
  if (w.kind === "LeaderWorkerSet") labels["leaderworkerset.sigs.k8s.io/name"] = w.metadata.name;
  return labels;
}

// Whether a label selector (matchLabels, or a Service's plain map) selects
// pods with `labels`.
function selects(selector, labels) {
  const match = selector?.matchLabels ?? selector ?? {};
  if ((selector?.matchExpressions ?? []).length) return false;  // not used here
  return Object.keys(match).length > 0 &&
    Object.entries(match).every(([k, v]) => labels[k] === v);
}

function argValue(container, flag) {
  const a = container.args.find((x) => x.startsWith(`${flag}=`));
  return a === undefined ? undefined : a.slice(flag.length + 1);
}

// Drain: SIGTERM starts each process's drain, bounded by
// --drain-timeout-seconds; preStop first lets the routers (and Services)
// take the pod out; the grace period must cover both and the stop.
function checkDrain(where, pod, c) {
  const drain = Number(argValue(c, "--drain-timeout-seconds"));
  if (!(drain > 0)) return fail(where, "args lack --drain-timeout-seconds");
  const cmd = c.lifecycle?.preStop?.exec?.command ?? [];
  if (cmd[0] !== "sleep" || !(Number(cmd[1]) > 0))
    return fail(where, "no preStop sleep: SIGTERM would come before the routers re-resolve");
  const grace = pod.spec.terminationGracePeriodSeconds ?? 30;
  if (grace < Number(cmd[1]) + drain + 5)
    fail(where, `terminationGracePeriodSeconds ${grace} < preStop ${cmd[1]} + drain ${drain} + 5`);
}

// The router finds the workers by DNS: each --decode / --prefill target is a
// headless Service (one record per pod) over Ready pods only, selecting the
// decode workers / the prefill groups' leaders (stage 0).
function checkDiscovery(objects, overlay, decode, lws) {
  const router = objects.find((o) => o.kind === "Deployment" && o.metadata.name === "router");
  if (!router) return fail(overlay, "no router Deployment");
  const c = router.spec.template.spec.containers[0];
  const check = (flag, labels, what) => {
    const target = argValue(c, flag);
    const [name, port] = (target ?? "").split(":");
    const svc = objects.find((o) => o.kind === "Service" && o.metadata.name === name);
    if (!svc) return fail(overlay, `router ${flag}=${target}: no Service ${name}`);
    if (svc.spec.clusterIP !== "None") fail(overlay, `Service ${name} must be headless (a record per pod)`);
    if (svc.spec.publishNotReadyAddresses) fail(overlay, `Service ${name} must list Ready pods only`);
    if (!selects(svc.spec.selector, labels)) fail(overlay, `Service ${name} does not select ${what}`);
    if (!(svc.spec.ports ?? []).some((p) => String(p.port) === port))
      fail(overlay, `Service ${name} has no port ${port}`);
  };
  check("--decode", podLabels(decode), "the decode workers");
  check("--prefill", { ...podLabels(lws), "leaderworkerset.sigs.k8s.io/worker-index": "0" },
        "the prefill groups' leaders");
  // A selector that also matched stages > 0 would hand the router a stage's
  // control port as a group.
  const leaders = objects.find((o) => o.kind === "Service" &&
    o.metadata.name === (argValue(c, "--prefill") ?? "").split(":")[0]);
  if (leaders && leaders.spec.selector?.["leaderworkerset.sigs.k8s.io/worker-index"] !== "0")
    fail(overlay, `Service ${leaders.metadata.name} must select worker-index 0 only`);
}

// KEDA: decode workers and prefill groups each scaled by a ScaledObject
// whose target exists, from pdserve's metrics through Prometheus.
function checkAutoscaling(objects, overlay, decode, lws) {
  for (const target of [decode, lws]) {
    const scalers = objects.filter((o) => o.kind === "ScaledObject" &&
      o.spec.scaleTargetRef.name === target.metadata.name &&
      (o.spec.scaleTargetRef.kind ?? "Deployment") === target.kind &&
      (o.spec.scaleTargetRef.apiVersion ?? "apps/v1") === target.apiVersion);
    const where = `${overlay} ScaledObject for ${target.kind}/${target.metadata.name}`;
    if (scalers.length !== 1) {
      fail(where, `${scalers.length} ScaledObjects target it (want 1)`);
      continue;
    }
    const so = scalers[0];
    if (!(so.spec.minReplicaCount >= 1))
      fail(where, "minReplicaCount must be >= 1 (scaling to zero drops every stream)");
    for (const t of so.spec.triggers) {
      if (t.type !== "prometheus") fail(where, `trigger ${t.name}: type ${t.type}, not prometheus`);
      const query = t.metadata?.query ?? "";
      if (!/pdserve_[a-z_]+/.test(query)) fail(where, `trigger ${t.name}: query reads no pdserve metric`);
      if (!(Number(t.metadata?.threshold) > 0)) fail(where, `trigger ${t.name}: no positive threshold`);
    }
  }
}

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
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet", "LeaderWorkerSet"].includes(o.kind));
  if (workloads.length < 3) fail(overlay, "expected router, prefill and decode workloads");
  for (const w of workloads) {
    const where = `${overlay} ${w.kind}/${w.metadata.name}`;
    const pod = podTemplate(w);
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
    checkDrain(where, pod, c);
    if (!objects.some((o) => o.kind === "PodDisruptionBudget" && selects(o.spec.selector, podLabels(w))))
      fail(where, "no PodDisruptionBudget covers its pods");
  }
  const lws = objects.find((o) => o.kind === "LeaderWorkerSet" && o.metadata.name === "prefill");
  if (!lws) return fail(overlay, "no prefill LeaderWorkerSet");
  const group = lws.spec.leaderWorkerTemplate;
  if (String(group.size) !== layout.data.PREFILL_STAGES)
    fail(overlay, `prefill group size ${group.size} != PREFILL_STAGES ${layout.data.PREFILL_STAGES}`);
  // A stage lost takes its group down (the pipeline must be rewired): the
  // group is replaced whole.
  if ((group.restartPolicy ?? "RecreateGroupOnPodRestart") !== "RecreateGroupOnPodRestart")
    fail(overlay, "prefill groups must restart whole (restartPolicy RecreateGroupOnPodRestart)");
  const decode = workloads.filter((w) => podTemplate(w).metadata.labels["pdserve.io/role"] === "decode");
  if (decode.length !== 1 || decode[0].kind !== "Deployment")
    fail(overlay, "decode workers must be one Deployment (its replicas are the workers)");
  checkDiscovery(objects, overlay, decode[0], lws);
  checkAutoscaling(objects, overlay, decode[0], lws);
  for (const d of decode) {
    const gpus = podTemplate(d).spec.containers[0].resources?.limits?.["nvidia.com/gpu"];
    if (gpus !== undefined && String(gpus) !== layout.data.DECODE_TP)
      fail(overlay, `${d.metadata.name}: nvidia.com/gpu ${gpus} != DECODE_TP ${layout.data.DECODE_TP}`);
  }
  // GPUs and the backend go together: a GPU pod running the CPU backend
  // wastes its GPUs, a cuda pod without one fails at start.
  const backend = layout.data.BACKEND;
  if (backend !== "cpu" && backend !== "cuda")
    return fail(overlay, `BACKEND ${backend} is neither cpu nor cuda`);
  for (const w of [...decode, lws]) {
    const gpus = podTemplate(w).spec.containers[0].resources?.limits?.["nvidia.com/gpu"];
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
