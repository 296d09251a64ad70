#!/usr/bin/env python3
"""Write the built-in model profiles (planner/profiles/*.json) from transformer shape formulas.

Shapes follow the published architectures; times assume 150 TFLOP/s sustained per device in bf16 (an A100 /
Ascend 910B class device), backward = 2 x forward, FLOPs by the formulas of the planner's Hugging Face
profiles (`planner/hf_profile.py`: matmul + attention); memory assumes bf16 parameters, Adam with fp32
master weights (12 bytes/param of optimizer state) and activations without recomputation (Korthikanti et
al.: 34 * s * h bytes per layer per sequence, flash attention). Re-run after changing a formula:
    python scripts/gen_profiles.py
"""

from __future__ import annotations

import json
from pathlib import Path

from resilientjob.planner.hf_profile import NOMINAL_FLOPS, attention_flops, embedding_flops, matmul_flops

FLOPS = NOMINAL_FLOPS
OUT = Path(__file__).resolve().parent.parent / "planner" / "profiles"

MODELS = {
    # name: (blocks, hidden, ffn, vocab, seq, gated_ffn)
    "llama2-7b": (32, 4096, 11008, 32000, 4096, True),
    "gpt3-2.7b": (32, 2560, 10240, 50257, 2048, False),
    "gpt3-6.7b": (32, 4096, 16384, 50257, 2048, False),
    "bert-large": (24, 1024, 4096, 30522, 512, False),
}


def layer(name: str, params: float, flops: float, activation: float, output: float) -> dict[str, object]:
    forward = flops / FLOPS
    return {
        "name": name,
        "forward_s": round(forward, 9),
        "backward_s": round(2 * forward, 9),
        "param_bytes": int(2 * params),
        "optimizer_bytes": int(12 * params),
        "activation_bytes": int(activation),
        "output_bytes": int(output),
    }


def profile(
    name: str, blocks: int, hidden: int, ffn: int, vocab: int, seq: int, gated: bool
) -> dict[str, object]:
    block_params = 4 * hidden * hidden + (3 if gated else 2) * hidden * ffn
    block_flops = matmul_flops(block_params, seq) + attention_flops(seq, seq, hidden)
    activation = 34 * seq * hidden
    output = 2 * seq * hidden
    embed_params = vocab * hidden
    layers = [layer("embedding", embed_params, embedding_flops(seq, hidden), 2 * seq * hidden, output)]
    layers += [layer(f"block{i}", block_params, block_flops, activation, output) for i in range(blocks)]
    layers.append(layer("head", embed_params, matmul_flops(embed_params, seq), 4 * seq * vocab, 0))
    return {
        "name": name,
        "notes": f"{blocks} blocks, hidden {hidden}, seq {seq}, micro-batch 1; scripts/gen_profiles.py",
        "layers": layers,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, shape in MODELS.items():
        (OUT / f"{name}.json").write_text(json.dumps(profile(name, *shape), indent=1) + "\n")


if __name__ == "__main__":
    main()
