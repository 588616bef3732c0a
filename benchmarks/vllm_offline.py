"""Run one batch of token-id prompts through vLLM's offline ``LLM.generate`` and time it.

``benchmarks/batch_engine.py`` starts this under another interpreter (vLLM's CPU build lives in
its own virtual environment, with its own torch and transformers), so it imports nothing from
slogate. It reads a JSON file ``{"model", "dtype", "max_model_len", "prompts": [[ids]],
"max_tokens": [n], "repeats": k}`` and prints one line ``vllm_offline result: {"output_tokens",
"seconds": [one per repeat]}`` (vLLM logs to stdout too). A short warm-up batch runs first so that, as for the paged engine,
start-up and compilation are not timed; prefix caching is off, as the warm-up would otherwise
leave cached blocks that the paged engine's fresh instance does not have. Run::

    /path/to/vllm-venv/bin/python benchmarks/vllm_offline.py jobs.json
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(
        model=spec["model"],
        dtype={"bf16": "bfloat16", "fp32": "float32"}[spec["dtype"]],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["max_tokens"]]
    llm.generate(prompts[:4], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4, use_tqdm=False)
    seconds = []
    for _ in range(spec.get("repeats", 1)):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print("vllm_offline result:", json.dumps({"output_tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
