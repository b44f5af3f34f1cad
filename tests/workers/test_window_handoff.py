"""1P1D with sliding windows (window 16): P sends each sliding layer only the KV D's first query
there can see (the last 15 of the hand-off's tokens), D places it at its positions in its own
blocks (P's blocks of 16, D's of 8); the output equals the colocated engine's, which equals
transformers'. Mistral (every layer windowed) and Gemma 3 (sliding and global layers)."""

from __future__ import annotations

import pytest

import tiny_arch
from factories import assert_cluster_idle
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.engine.models.arch import ModelArch
from pdserve.transfer.wire import HEADER_FIXED_SIZE, MAX_REQUEST_ID_BYTES

WINDOW = 16
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _payload(arch: ModelArch, num_kv: int, per_layer_from: list[int]) -> int:
    """Float32 K and V bytes of tokens [from, num_kv) of each layer."""
    row = arch.num_kv_heads * arch.head_dim * 4
    return sum(2 * (num_kv - first) * row for first in per_layer_from)


def _sent(c: LocalCluster, prompt: list[int]) -> tuple[list[int], int, int]:
    """(tokens, KV bytes sent, frames sent) of one request through the cluster."""
    before = dict(c.stats)
    (out,) = c.generate([prompt], GREEDY)
    assert out.error is None, out.error
    sent = c.stats["kv_send_bytes"] - before.get("kv_send_bytes", 0)
    frames = c.stats["kv_send_frames"] - before.get("kv_send_frames", 0)
    return out.outputs[0].token_ids, sent, frames


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_handoff_sends_each_layer_its_window(tmp_path, default_tokenizer, name) -> None:  # type: ignore[no-untyped-def]
    ref = tiny_arch.save(tmp_path, name, default_tokenizer, sliding_window=WINDOW)
    (long,) = tiny_arch.prompts((120,), seed=3)
    colocated = LLM(str(tmp_path), block_size=8)
    arch = colocated.engine.arch
    first = colocated.generate([long], GREEDY)[0].outputs[0].token_ids
    assert first == tiny_arch.hf_greedy(ref, long, GREEDY.max_tokens)
    # the next turn: the first, its answer and more tokens; and a prompt sharing 96 tokens
    more = tiny_arch.prompts((30,), seed=4)[0]
    turn, shared = long + first + more[:10], long[:96] + more
    second, third = [o.outputs[0].token_ids for o in colocated.generate([turn, shared], GREEDY)]
    with LocalCluster(
        str(tmp_path),
        transport="inproc",
        prefill_args={"block_size": 16},
        decode_args={"block_size": 8},
    ) as c:
        got, nbytes, frames = _sent(c, long)
        assert got == first
        num_kv = len(long)  # the prompt's KV; D computes its last token
        starts = [arch.kv_needed_from(i, num_kv) for i in range(arch.num_layers)]
        sliding = [arch.is_sliding(i) for i in range(arch.num_layers)]
        assert all(sliding) == (name == "mistral-window") and any(sliding)
        assert [s > 0 for s in starts] == sliding
        want = _payload(arch, num_kv, starts)
        assert want <= nbytes <= want + frames * (HEADER_FIXED_SIZE + MAX_REQUEST_ID_BYTES)
        full = _payload(arch, num_kv, [0] * arch.num_layers)
        assert nbytes < (0.2 if name == "mistral-window" else 0.6) * full, (nbytes, full)

        # D received no KV of the window layers before token 105: a hit on blocks before then
        # would read what never came there (the shared prompt's first query sees tokens 81-96)
        got, _, _ = _sent(c, shared)
        assert got == third
        assert c.worker_stats()["D0"]["kv_tokens_reused"] == 0
        got, _, _ = _sent(c, turn)
        assert got == second
        reused = c.worker_stats()["D0"]["kv_tokens_reused"]
        # D registered the first turn's full blocks from its window on (the blocks before
        # never came), decoded ones included: the last two (the window of the hit's end)
        # make a hit of every full block of that turn's KV, found from the right. Gemma 3's
        # global layers have their own KV group (engine/hybrid_kv.py), whose blocks all came
        # whole: the same hit.
        assert reused == (len(long) + GREEDY.max_tokens - 1) // 8 * 8
        assert_cluster_idle(c)


def test_handoff_after_decode_steps_on_p_without_streaming(tmp_path, default_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """P computes the prompt in chunks in a cache too small for it and decodes 2 tokens itself
    (its blocks leaving the window and taken again as it goes), then sends the window of all
    122 KV tokens from its cache after the prefill: what D needs is still there."""
    tiny_arch.save(tmp_path, "mistral-window", default_tokenizer, sliding_window=WINDOW)
    (long,) = tiny_arch.prompts((120,), seed=3)
    colocated = LLM(str(tmp_path), block_size=8)
    arch = colocated.engine.arch
    want = colocated.generate([long], GREEDY)[0].outputs[0].token_ids
    with LocalCluster(
        str(tmp_path),
        transport="inproc",
        handoff_tokens=3,
        stream_kv=False,
        # 4 usable blocks, chunks of 32: P's blocks must be taken again as the window moves
        prefill_args={"block_size": 16, "num_blocks": 5, "max_num_batched_tokens": 32},
        decode_args={"block_size": 8},
    ) as c:
        got, nbytes, frames = _sent(c, long)
        assert got == want
        num_kv = len(long) + 2
        starts = [arch.kv_needed_from(i, num_kv) for i in range(arch.num_layers)]
        assert starts == [num_kv - WINDOW + 1] * arch.num_layers
        payload = _payload(arch, num_kv, starts)
        assert payload <= nbytes <= payload + frames * (HEADER_FIXED_SIZE + MAX_REQUEST_ID_BYTES)
        assert_cluster_idle(c)


@pytest.mark.parametrize("stream_kv", [True, False])
def test_mixed_model_handoff_from_small_kv_groups(tmp_path, default_tokenizer, stream_kv) -> None:  # type: ignore[no-untyped-def]
    """Gemma 3 with a KV group per kind of layer on both sides (engine/hybrid_kv.py): P computes
    the prompt in chunks of 32 and decodes 2 tokens with 5 usable sliding blocks (freed and
    taken again as the window moves), reads each sliding layer's window from its own group's
    blocks, D writes it into its own sliding group: D's tokens equal the colocated engine's."""
    tiny_arch.save(tmp_path, "gemma3", default_tokenizer, sliding_window=WINDOW)
    (long,) = tiny_arch.prompts((120,), seed=3)
    colocated = LLM(str(tmp_path), block_size=8)
    want = colocated.generate([long], GREEDY)[0].outputs[0].token_ids
    small = {"max_num_seqs": 1, "max_num_batched_tokens": 32}
    with LocalCluster(
        str(tmp_path),
        transport="inproc",
        handoff_tokens=3,
        stream_kv=stream_kv,
        prefill_args={"block_size": 16, "num_blocks": 12, **small},
        decode_args={"block_size": 8, "num_blocks": 40, **small},
    ) as c:
        sizes = {w: (s["kv_blocks_total"]) for w, s in c.worker_stats().items()}
        assert sizes == {"P0": 18 + 5, "D0": 65 + 14}, sizes  # global + sliding (null block out)
        got, _, _ = _sent(c, long)
        assert got == want
        assert_cluster_idle(c)
