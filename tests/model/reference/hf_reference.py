#!/usr/bin/python3
"""A float64 reference forward pass for Llama-family checkpoints in Hugging
Face layout (config.json + model.safetensors), written from the families'
public definitions: transformers' modeling_llama / modeling_mistral /
modeling_qwen2 / modeling_qwen3, the mixtures of experts modeling_qwen3_moe /
modeling_qwen2_moe / modeling_mixtral, and the RoPE init functions of
modeling_rope_utils. It shares no code with pdserve (numpy only) and is the
independent side of the family tests.

  hf_reference.py MODEL_DIR [--prompt-ids 1,2,3] [--max-new N]

prints one JSON object: prompt_ids, greedy_ids (greedy continuation, stops
after an end token), logprobs (of each greedy token), prompt_logprobs
(log p(prompt[k] | prompt[:k]) for k >= 1), min_margin (the smallest gap
between the best and second-best logit over all greedy steps) and, for a
mixture of experts, min_route_margin (the smallest gap between a token's
k-th and (k+1)-th expert probability in any sparse layer: where that is
tiny, an f32 engine may pick another expert and no comparison holds). Without
--prompt-ids the ids come from MODEL_DIR/prompt.json.

Semantics worth stating:
  * Every step recomputes the whole sequence (no cache). That equals the
    cached computation of transformers for all types but dynamic NTK, whose
    frequencies there depend on the longest position of the forward call;
    here token p always rotates with the frequencies of seq_len = p + 1,
    which is what transformers computes when each token is its own step.
  * Sliding window (Mistral; Qwen2/3 with use_sliding_window, in the layers
    layer_types or max_window_layers make "sliding_attention"): query i sees
    keys j with i - window < j <= i, transformers' sliding_window_overlay.
  * yarn's attention factor multiplies cos and sin, as transformers'
    rotary embedding does (so q.k scales by its square).
  * Experts (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock,
    MixtralSparseMoeBlock): softmax over the router logits, torch.topk (the
    lower index first on ties), renormalised with norm_topk_prob (Mixtral
    always); Qwen2-MoE adds sigmoid(shared_expert_gate(x)) * shared_expert(x).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "BF16":
            raw = np.frombuffer(data[base + begin : base + end], dtype=np.uint16)
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(
                data[base + begin : base + end], dtype=DTYPES[entry["dtype"]]
            )
        tensors[name] = values.astype(np.float64).reshape(entry["shape"])
    return tensors


class Config:
    """The keys each family's transformers config class reads, with its
    defaults."""

    def __init__(self, raw):
        self.model_type = raw.get("model_type", "llama")
        known = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
        if self.model_type not in known:
            raise ValueError("unsupported model_type " + self.model_type)
        # The attention each MoE family shares with a dense one.
        attention = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}.get(
            self.model_type, self.model_type
        )
        self.hidden = raw["hidden_size"]
        self.layers = raw["num_hidden_layers"]
        self.heads = raw["num_attention_heads"]
        self.kv_heads = raw.get("num_key_value_heads") or self.heads
        default_head_dim = 128 if self.model_type == "qwen3" else None
        self.head_dim = (
            raw.get("head_dim") or default_head_dim or self.hidden // self.heads
        )
        self.eps = raw["rms_norm_eps"]
        self.theta = raw.get("rope_theta", 10000.0)
        self.max_position = raw["max_position_embeddings"]
        self.rope_scaling = raw.get("rope_scaling")
        self.tie = raw.get("tie_word_embeddings", False)
        # Attention projections as each modeling file builds them.
        bias = raw.get("attention_bias", False)
        self.qkv_bias = {"llama": bias, "qwen3": bias, "qwen2": True}.get(
            attention, False
        )
        self.o_bias = {"llama": bias, "qwen3": bias}.get(attention, False)
        self.qk_norm = attention == "qwen3"
        # The window of each layer (None: the whole context).
        if attention == "mistral":
            # MistralConfig's default window is 4096, MixtralConfig's None.
            default = 4096 if self.model_type == "mistral" else None
            window = raw["sliding_window"] if "sliding_window" in raw else default
            self.windows = [window] * self.layers
        elif attention in ("qwen2", "qwen3"):
            # Qwen2Config: sliding_window only with use_sliding_window; the
            # layer kinds from layer_types, else sliding for layer indices
            # >= max_window_layers (default 28).
            window = (
                raw.get("sliding_window", 4096)
                if raw.get("use_sliding_window", False)
                else None
            )
            kinds = raw.get("layer_types") or [
                "sliding_attention"
                if window is not None and i >= raw.get("max_window_layers", 28)
                else "full_attention"
                for i in range(self.layers)
            ]
            self.windows = [
                window if kind == "sliding_attention" else None for kind in kinds
            ]
        else:
            self.windows = [None] * self.layers
        # Experts: which layers are sparse and how they route.
        self.sparse = [False] * self.layers
        if self.model_type == "mixtral":
            self.experts = raw.get("num_local_experts", 8)
            self.top_k = raw.get("num_experts_per_tok", 2)
            self.expert_width = raw["intermediate_size"]
            self.norm_topk = True
            self.sparse = [True] * self.layers
        elif self.model_type in ("qwen3_moe", "qwen2_moe"):
            qwen2 = self.model_type == "qwen2_moe"
            self.experts = raw.get("num_experts", 60 if qwen2 else 128)
            self.top_k = raw.get("num_experts_per_tok", 4 if qwen2 else 8)
            self.expert_width = raw.get("moe_intermediate_size", 1408 if qwen2 else 768)
            self.norm_topk = raw.get("norm_topk_prob", False)
            step = raw.get("decoder_sparse_step", 1)
            dense_only = raw.get("mlp_only_layers") or []
            self.sparse = [
                i not in dense_only and self.experts > 0 and (i + 1) % step == 0
                for i in range(self.layers)
            ]
        self.shared = self.model_type == "qwen2_moe"
        self.route_margins = []
        eos = raw.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def default_inv_freq(base, dim):
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope_inv_freq(cfg, seq_len):
    """(inverse frequencies, attention factor) for a sequence of seq_len,
    after modeling_rope_utils' init function of the scaling type."""
    dim = cfg.head_dim
    scaling = cfg.rope_scaling
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return default_inv_freq(cfg.theta, dim), 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return default_inv_freq(cfg.theta, dim) / factor, 1.0
    if kind == "dynamic":
        original = cfg.max_position
        seq_len = max(seq_len, original)
        base = cfg.theta * ((factor * seq_len / original) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return default_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv = default_inv_freq(cfg.theta, dim)
        old = scaling["original_max_position_embeddings"]
        low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
        low_wavelen, high_wavelen = old / low_ff, old / high_ff
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or cfg.max_position
        attention = scaling.get("attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention is None:
            if mscale and mscale_all:
                attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            else:
                attention = get_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (
                2 * math.log(cfg.theta)
            )

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = cfg.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
            1.0 / pos_freqs
        ) * extrapolation
        return inv, attention
    raise ValueError("unsupported rope type %r" % kind)


def rotary(cfg, positions):
    """cos, sin of shape [len, head_dim] (rotate-half layout)."""
    cos = np.empty((len(positions), cfg.head_dim))
    sin = np.empty_like(cos)
    for row, p in enumerate(positions):
        inv, attention = rope_inv_freq(cfg, p + 1)
        angles = p * inv
        emb = np.concatenate([angles, angles])
        cos[row] = np.cos(emb) * attention
        sin[row] = np.sin(emb) * attention
    return cos, sin


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rms_norm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(w, prefix, gate, up, down, h):
    g = h @ w[prefix + gate + ".weight"].T
    u = h @ w[prefix + up + ".weight"].T
    return (silu(g) * u) @ w[prefix + down + ".weight"].T


def sparse_mlp(cfg, w, layer, h):
    """A sparse layer's output for rows h [n, hidden]."""
    p = "model.layers.%d." % layer
    mixtral = cfg.model_type == "mixtral"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    logits = h @ w[block + "gate.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # torch.topk order: most probable first, the lower index on ties.
    order = np.argsort(-probs, axis=-1, kind="stable")
    k = cfg.top_k
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = order[t, :k]
        weights = probs[t, chosen]
        if cfg.norm_topk:
            weights = weights / weights.sum()
        if k < cfg.experts:
            cfg.route_margins.append(probs[t, order[t, k - 1]] - probs[t, order[t, k]])
        for e, weight in zip(chosen, weights):
            prefix = block + "experts.%d." % e
            if mixtral:
                y = swiglu(w, prefix, "w1", "w3", "w2", h[t : t + 1])
            else:
                y = swiglu(w, prefix, "gate_proj", "up_proj", "down_proj", h[t : t + 1])
            out[t] += weight * y[0]
    if cfg.shared:
        gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "mlp.shared_expert_gate.weight"].T)))
        shared = swiglu(w, p + "mlp.shared_expert.", "gate_proj", "up_proj", "down_proj", h)
        out += gate * shared
    return out


def forward(cfg, w, ids, rows=None):
    """Logits [len(rows), vocab] of positions `rows` (all when None) of the
    whole sequence."""
    n = len(ids)
    hd, heads, kv_heads = cfg.head_dim, cfg.heads, cfg.kv_heads
    x = w["model.embed_tokens.weight"][np.array(ids)]
    cos, sin = rotary(cfg, list(range(n)))
    # Causal mask plus each layer's sliding window.
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    causal = j <= i
    for layer in range(cfg.layers):
        p = "model.layers.%d." % layer
        visible = causal
        if cfg.windows[layer]:
            visible = causal & (j > i - cfg.windows[layer])
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.eps)

        def proj(name, bias):
            y = h @ w[p + "self_attn.%s.weight" % name].T
            if bias:
                y = y + w[p + "self_attn.%s.bias" % name]
            return y

        q = proj("q_proj", cfg.qkv_bias).reshape(n, heads, hd).transpose(1, 0, 2)
        k = proj("k_proj", cfg.qkv_bias).reshape(n, kv_heads, hd).transpose(1, 0, 2)
        v = proj("v_proj", cfg.qkv_bias).reshape(n, kv_heads, hd).transpose(1, 0, 2)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg.eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = heads // kv_heads
        k = np.repeat(k, group, axis=0)
        v = np.repeat(v, group, axis=0)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, heads * hd)
        out = attn @ w[p + "self_attn.o_proj.weight"].T
        if cfg.o_bias:
            out = out + w[p + "self_attn.o_proj.bias"]
        x = x + out
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.eps)
        if cfg.sparse[layer]:
            x = x + sparse_mlp(cfg, w, layer, h)
        else:
            x = x + swiglu(w, p + "mlp.", "gate_proj", "up_proj", "down_proj", h)
    if rows is not None:
        x = x[rows]
    x = rms_norm(x, w["model.norm.weight"], cfg.eps)
    head = w["model.embed_tokens.weight"] if cfg.tie else w["lm_head.weight"]
    return x @ head.T


def log_softmax(row):
    shifted = row - row.max()
    return shifted - math.log(np.exp(shifted).sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompt-ids", default=None)
    parser.add_argument("--max-new", type=int, default=16)
    args = parser.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = Config(json.load(f))
    weights = load_safetensors(os.path.join(args.model_dir, "model.safetensors"))
    if args.prompt_ids is not None:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        with open(os.path.join(args.model_dir, "prompt.json")) as f:
            prompt = json.load(f)["prompt_ids"]

    ids = list(prompt)
    greedy, logprobs, margins = [], [], []
    prompt_logprobs = []
    for step in range(args.max_new):
        # All positions once (the prompt's scores), then only the last.
        logits = forward(cfg, weights, ids, None if step == 0 else [len(ids) - 1])
        if step == 0:
            for k in range(1, len(prompt)):
                prompt_logprobs.append(float(log_softmax(logits[k - 1])[prompt[k]]))
        last = logits[-1]
        token = int(np.argmax(last))
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        greedy.append(token)
        logprobs.append(float(log_softmax(last)[token]))
        ids.append(token)
        if token in cfg.eos:
            break
    json.dump(
        {
            "prompt_ids": prompt,
            "greedy_ids": greedy,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "min_margin": min(margins) if margins else None,
            "min_route_margin": float(min(cfg.route_margins)) if cfg.route_margins else None,
        },
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
