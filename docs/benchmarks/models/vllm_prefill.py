"""vLLM CPU prefill tokens/s on an HF folder: unique random-token prompts, max_tokens=1, medians.
Usage: vllm_prefill.py HF_FOLDER [OUT.json] (vLLM logs to stdout too: the file holds only the result)."""
import os, sys, time, random, statistics, json
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ["VLLM_NO_USAGE_STATS"] = "1"
from vllm import LLM, SamplingParams
def main():
    folder = sys.argv[1]
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(1)
    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}
    llm.generate([prompt(256)], sp, use_tqdm=False)
    out = {}
    for n in (512, 2048):
        ts = []
        for _ in range(3):
            p = prompt(n)
            t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); ts.append(time.perf_counter() - t)
        out[n] = {"median_s": statistics.median(ts), "tok_s": n / statistics.median(ts), "runs_s": ts}
    print(json.dumps(out))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
