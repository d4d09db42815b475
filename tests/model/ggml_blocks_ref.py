#!/usr/bin/python3
"""Independent dequantizer for the GGML block formats (Q8_0, Q4_K, Q6_K),
written from the formats' public description with numpy, not from pdserve's
code. tests/model/quant_formats_test.cc checks pdserve's DequantizeRow
against it bit for bit.

    ggml_blocks_ref.py FORMAT IN OUT

reads whole blocks of FORMAT from IN and writes the values as little-endian
float32 to OUT. Arithmetic is float32 in the order the format's reference
dequantizer uses ((d * scale) * q, then - dmin * min), so results are exact
matches, not approximations.
"""
import sys

import numpy as np


def f16(raw):
    return raw.view("<f2").astype(np.float32)


def q8_0(data):
    blocks = data.reshape(-1, 34)
    d = f16(blocks[:, 0:2].copy())  # [n, 1]
    q = blocks[:, 2:34].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


def q4_k_scale_min(scales):
    """The eight 6-bit (scale, min) pairs packed into 12 bytes."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    for j in range(4):
        sc[:, j] = s[:, j] & 63
        mn[:, j] = s[:, j + 4] & 63
    for j in range(4, 8):
        sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
        mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def q4_k(data):
    blocks = data.reshape(-1, 144)
    d = f16(blocks[:, 0:2].copy())
    dmin = f16(blocks[:, 2:4].copy())
    sc, mn = q4_k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:144]
    out = np.empty((blocks.shape[0], 256), np.float32)
    for c in range(4):
        chunk = qs[:, 32 * c:32 * c + 32]
        for half, q in ((0, chunk & 0xF), (1, chunk >> 4)):
            j = 2 * c + half
            scale = (d[:, 0] * sc[:, j])[:, None]
            minimum = (dmin[:, 0] * mn[:, j])[:, None]
            out[:, 32 * j:32 * j + 32] = scale * q.astype(np.float32) - minimum
    return out.reshape(-1)


def q6_k(data):
    blocks = data.reshape(-1, 210)
    ql = blocks[:, 0:128]
    qh = blocks[:, 128:192]
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = f16(blocks[:, 208:210].copy())
    out = np.empty((blocks.shape[0], 256), np.float32)
    for h in range(2):  # two halves of 128 values
        for k in range(4):  # four rows of 32 within a half
            low_bytes = ql[:, 64 * h + 32 * (k & 1):64 * h + 32 * (k & 1) + 32]
            low = (low_bytes & 0xF) if k < 2 else (low_bytes >> 4)
            high = (qh[:, 32 * h:32 * h + 32] >> (2 * k)) & 3
            q = (low | (high << 4)).astype(np.int32) - 32
            first = 128 * h + 32 * k
            for part in range(2):  # one scale per 16 values
                idx = slice(first + 16 * part, first + 16 * part + 16)
                scale = (d[:, 0] * scales[:, (first + 16 * part) // 16])[:, None]
                out[:, idx] = scale * q[:, 16 * part:16 * part + 16].astype(
                    np.float32)
    return out.reshape(-1)


def main():
    fmt, src, dst = sys.argv[1:4]
    data = np.fromfile(src, dtype=np.uint8)
    values = {"Q8_0": q8_0, "Q4_K": q4_k, "Q6_K": q6_k}[fmt](data)
    values.astype("<f4").tofile(dst)


if __name__ == "__main__":
    main()
