"""Does an engine follow `torch.set_num_threads` changed at run time, down and up? (`--adaptive`
moves threads between P and D by exactly this call, router/threads.py.)

    python scripts/check_thread_moves.py [--counts 1,4,2,8]

For each count, in turn in one process: set it, run a matmul and a default-model generation
(its GGUF projections and the paged attention kernel), and count the OS threads of this process
that used at least 20 ms of CPU during it (/proc/self/task/*/stat). An engine that follows prints
the count it was given (on a quiet machine; a loaded one may show fewer for short runs), and
every generation's tokens equal the first's.
"""

from __future__ import annotations

import argparse
import os

import torch


def cpu_ticks() -> dict[str, int]:
    out = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[task] = int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return out


def busy_threads(run) -> int:  # type: ignore[no-untyped-def]
    before = cpu_ticks()
    run()
    after = cpu_ticks()
    return sum(1 for t, n in after.items() if n - before.get(t, 0) >= 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,2,1,2", help="thread counts, in order")
    counts = [int(c) for c in parser.parse_args().counts.split(",")]
    from pdserve import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = [list(range(100, 400))]
    a = torch.randn(1024, 1024)
    first = None
    tokens: list[list[int]] = []

    def generate() -> None:
        tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    for n in counts:
        torch.set_num_threads(n)
        mm = busy_threads(lambda: [a @ a for _ in range(30)])
        gen = busy_threads(generate)
        first = first or tokens[0]
        same = tokens[-1] == first
        print(f"threads {n}: matmul on {mm}, generation on {gen}, same tokens {same}")


if __name__ == "__main__":
    main()
