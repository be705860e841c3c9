"""`--quantization int8|int4` on the embedded model (SmolLM2-135M), and the low-bit CPU kernels.

Bounds, measured first on this model and this 76-token text (fp32: -3.632 nats/token): int8 per channel moved
it by 0.021, int4 symmetric per group of 64/128 columns by 0.268 (variants measured on the same text: asymmetric
0.221, group 32 0.411, an MSE clip search 0.45; one short text is a noisy judge, so the bounds keep ~2x / ~1.3x
margin): INT8_NATS 0.05, INT4_NATS 0.35 nats/token. Weight bytes of the decoder
linears fall to at most 0.26 (int8: 1 byte + a 4-byte scale per 576-column row) and 0.15 (int4: half a
byte + a 4-byte scale per 64 or 128 columns) of fp32's.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLM
from engine.models import quant, quant_cpu
from engine.models.quant import QuantTensor, quantized_modules
from engine.sampling.params import SamplingParams

INT8_NATS, INT4_NATS = 0.05, 0.35
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
        "the waves below. Ships passed in the night, their lights blinking like distant stars, and he wrote each "
        "one in a worn leather book. In the morning he walked to the village to buy bread, milk and the paper, "
        "and the baker always asked him whether the sea had been calm.")


def mean_logprob(llm: LLM, ids: list[int]) -> float:
    """Teacher-forced mean log-probability per token of ids[1:]."""
    logp = torch.log_softmax(llm.prompt_logits(ids).float(), dim=-1)[:-1]
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def _llm(quantization: str) -> LLM:
    return LLM(EngineConfig(max_total_tokens=2048, page_size=16, chunked_prefill_size=128, threads=2,
                            quantization=quantization))


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def fp32(text_ids):
    llm = _llm("none")
    linear_bytes = sum(m.weight.numel() * 4 for name, m in llm.runner.model.layers.named_modules()
                       if isinstance(m, torch.nn.Linear) and m.packed is None) + sum(
        sum(p.numel() for p in (m.packed if isinstance(m.packed, tuple) else (m.packed,))) * 4
        for m in llm.runner.model.layers.modules() if isinstance(m, torch.nn.Linear) and m.packed is not None)
    return mean_logprob(llm, text_ids), linear_bytes


@pytest.mark.parametrize("scheme,nats,byte_ratio", [("int8", INT8_NATS, 0.26), ("int4", INT4_NATS, 0.15)])
def test_quantized_embedded_model(scheme, nats, byte_ratio, fp32, text_ids):
    ref_logprob, ref_bytes = fp32
    llm = _llm(scheme)
    quants = quantized_modules(llm.runner.model)
    assert len(quants) == 4 * llm.runner.model_cfg.num_layers  # qkv, o, gate_up, down per layer
    assert all(q.scheme == scheme and q.scale.dtype == torch.float32 for _, q in quants)
    got_bytes = sum(q.nbytes() for _, q in quants)
    assert got_bytes < byte_ratio * ref_bytes, (got_bytes, ref_bytes)
    diff = abs(mean_logprob(llm, text_ids) - ref_logprob)
    assert diff < nats, f"{scheme}: mean log-prob moved {diff:.4f} nats/token from fp32's {ref_logprob:.4f}"
    out = llm.generate([text_ids[:20]], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert len(out[0].output_ids) == 8
    assert llm.scheduler.kv.all_free()


def test_quantization_of_a_quantized_checkpoint_is_refused(monkeypatch, model_dir):
    """--quantization over a checkpoint that ships quantized (here: its quantization_config stubbed) is refused."""
    from engine.config import ModelConfig
    from engine.models import loader
    from engine.models.quant import QuantScheme

    monkeypatch.setattr(loader, "parse", lambda raw: QuantScheme("fp8", (128, 128)))
    with pytest.raises(ValueError, match="already quantized .*block FP8.*drop --quantization"):
        loader.load_model(model_dir, ModelConfig.from_dir(model_dir), "float32", "cpu", 64, quantization="int8")


def _random_quant(out: int, cols: int, scheme: str, group: int, asym: bool, g: torch.Generator) -> QuantTensor:
    bits = 8 if scheme == "int8" else 4
    q = torch.randint(0, 1 << bits, (out, cols), generator=g, dtype=torch.int16)
    data = q.to(torch.uint8) if bits == 8 else (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    scale = torch.rand(out, cols // group, generator=g) * 0.02 + 1e-3
    zero = None
    if asym:
        half = 1 << (bits - 1)
        zero = torch.randint(-half, half, (out, cols // group), generator=g, dtype=torch.int16).to(torch.int8)
    return QuantTensor(data.contiguous(), scale, group, scheme, zero, cols)


@pytest.mark.skipif(not quant_cpu.available(), reason="no C compiler: the kernels are not built")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_the_dequantize_path(threads):
    """quant_cpu's kernels (GEMV-style for few rows, C dequantize + dense GEMM above DENSE_ROWS) against
    F.linear over QuantTensor.dequant, on random shapes, groups, zero points and row counts."""
    g = torch.Generator().manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for scheme, group, cols, out, asym in [("int8", 96, 96, 40, False), ("int8", 32, 256, 17, True),
                                               ("int4", 16, 48, 33, False), ("int4", 64, 576, 70, True),
                                               ("int4", 128, 1536, 9, False)]:
            w = _random_quant(out, cols, scheme, group, asym, g)
            ref_w = w.dequant()
            for rows in (1, 2, 3, 4, 5, 9, quant_cpu.DENSE_ROWS + 1, 40):
                x = torch.randn(rows, cols, generator=g)
                bias = torch.randn(out, generator=g)
                want = torch.nn.functional.linear(x.double(), ref_w.double(), bias.double())
                got = w.linear(x, bias)
                assert quant_cpu.fits(x, w.qdata, w.scale, w.zero, scheme, group, cols)
                tol = 1e-5 * want.abs().max().item()
                assert (got.double() - want).abs().max().item() < tol, (scheme, group, cols, out, asym, rows)
            assert torch.equal(quant_cpu.dequant(w.qdata, w.scale, w.zero, scheme, group, cols), ref_w)
    finally:
        torch.set_num_threads(old)


def test_quantize_rounds_to_nearest():
    w = torch.randn(24, 256)
    for scheme, step in (("int8", 127), ("int4", 7)):
        q = quant.quantize(w, scheme)
        deq = q.dequant()
        per = w.unflatten(1, (-1, q.group)).abs().amax(-1, keepdim=True) / step  # the scale of each group
        assert ((deq - w).unflatten(1, (-1, q.group)).abs() <= per / 2 + 1e-6).all()
    assert quant.quantize(w, "int4").group == 128 and quant.int4_group(576) == 64
