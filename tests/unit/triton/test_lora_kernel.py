"""The Triton SGMV LoRA kernel (engine/extras/lora/triton_sgmv.py) against the CPU segmented matmul
(engine/extras/lora/batch.py): adapters of different ranks and targets in the registry's CUDA slot stacks,
mixed batches (base rows in between, scattered and contiguous runs, prefill-length segments), fp32
and bf16. Runs under TRITON_INTERPRET=1 without a GPU (tests/unit/triton/conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.extras.lora.batch import LoRABatch
from engine.extras.lora.registry import LoRARegistry
from engine.extras.lora.triton_sgmv import sgmv

CFG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
       "max_position_embeddings": 256}
SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
          "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}  # (out, in)


def write_adapter(dst, rank: int, targets: list[str], seed: int):  # noqa: ANN001, ANN201
    """A PEFT-format adapter directory with random A and B (written by hand: no peft needed)."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for layer in range(CFG["num_hidden_layers"]):
        for name in targets:
            sub = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out, inp = SHAPES[name]
            key = f"base_model.model.model.layers.{layer}.{sub}.{name}.lora_"
            t[key + "A.weight"] = torch.randn(rank, inp, generator=g) * 0.3
            t[key + "B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": targets}))
    save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgmv")
    reg = LoRARegistry(ModelConfig.from_hf(CFG), slots=4, max_rank=8)
    reg.stacks = {}  # the CUDA layout on any device: slot stacks A [S, R, in], B [S, out, R]
    specs = {"r2": (2, ["q_proj", "v_proj"]), "r8": (8, list(SHAPES)), "r4": (4, ["o_proj", "down_proj", "up_proj"])}
    for i, (name, (rank, targets)) in enumerate(specs.items()):
        reg.load(name, str(write_adapter(root / name, rank, targets, i)))
    return reg


BATCHES = [  # (adapter, tokens) per segment
    [("r2", 1), ("", 1), ("r8", 1), ("r4", 1), ("r8", 1), ("", 1)],  # decode rows, scattered
    [("r8", 37), ("", 5), ("r2", 19), ("r2", 3), ("r4", 1)],  # prefill runs longer than a block
    [("r4", 16), ("r4", 16), ("", 2)],  # a run merged across segments, exactly one block each
]


@pytest.mark.parametrize(("batch", "dtype"), [(BATCHES[0], torch.float32), (BATCHES[1], torch.float32),
                                              (BATCHES[2], torch.float32), (BATCHES[1], torch.bfloat16)])
def test_sgmv_matches_cpu_segmented_matmul(registry, device, batch, dtype):
    names, lens = [n for n, _ in batch], [t for _, t in batch]
    lb = registry.batch(names, lens)  # the CUDA layout: segments over slot stacks
    ref = LoRABatch.build(names, lens, registry.adapters, torch.device("cpu"), registry.concat)  # the CPU path
    assert lb is not None and lb.slots is not None and ref is not None
    t = sum(lens)
    g = torch.Generator().manual_seed(len(batch))
    for (layer, module), (a, b) in sorted(registry.stacks.items()):
        if layer:  # layer 0 holds every module kind; the interpreter is slow
            continue
        x = torch.randn(t, a.shape[2], generator=g)
        base = torch.randn(t, b.shape[1], generator=g)
        want = ref.apply(layer, module, x, base.clone())  # the CPU path: adapters side by side, masked
        sg = lb.slots
        got = sgmv(x.to(device, dtype), base.to(device, dtype), a.to(device, dtype), b.to(device, dtype),
                   sg.start.to(device), sg.length.to(device), sg.slot.to(device), sg.max_len).float().cpu()
        tol = 1e-4 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
        assert (got - want).abs().max().item() < tol, (layer, module)
        base_rows = [i for i, n in enumerate(n for n, k in batch for _ in range(k)) if not n]
        assert torch.equal(got[base_rows], base.to(dtype).float()[base_rows])  # base rows untouched


def test_unloaded_slot_is_zeroed_and_reused(registry, tmp_path):
    reg = registry
    slot = reg.slot_of["r2"]
    reg.unload("r2")
    assert all(not a[slot].any() and not b[slot].any() for a, b in reg.stacks.values())
    reg.load("r2b", str(write_adapter(tmp_path / "r2b", 2, ["q_proj"], 9)))
    assert reg.slot_of["r2b"] == slot
