"""The KV manager's side of the KV pool (engine/pool_link.py): which blocks were registered,
which still hold their hash, and fresh blocks for KV loaded from the pool. A base class of
`KVCacheManager` (engine/kv_cache_manager.py), which owns the state it reads."""

from __future__ import annotations

from pdserve.engine.block_pool import Block, BlockHash, BlockPool
from pdserve.engine.kv_window import PrefixHit
from pdserve.engine.request import Request


class PoolBlocks:
    block_size: int
    enable_prefix_caching: bool
    pool: BlockPool
    _blocks: dict[str, list[Block | None]]
    _registered: list[tuple[str, int, int, BlockHash]]
    _pins: dict[str, list[Block]]

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        raise NotImplementedError

    def _lookup(self, request: Request, max_tokens: int) -> PrefixHit:
        raise NotImplementedError

    def take_registered(self) -> list[tuple[str, int, int, BlockHash]]:
        """Blocks registered since the last call: (request id, index, block id, hash)."""
        out, self._registered = self._registered, []
        return out

    def registered_blocks(
        self, request_id: str, start: int, end: int
    ) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the request's blocks [start, end) while each is registered (a
        full block in the prefix cache); stops at the first that is not."""
        out: list[tuple[int, BlockHash]] = []
        for block in self._blocks.get(request_id, [])[start:end]:
            if block is None or block.block_hash is None:
                break
            out.append((block.block_id, block.block_hash))
        return out

    def block_holds(self, block_id: int, block_hash: BlockHash) -> bool:
        """Whether block `block_id` still holds the KV named `block_hash`."""
        return self.pool.blocks[block_id].block_hash == block_hash

    def chain(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks before its last token (which the model must
        compute): what a pool may hold for it."""
        if not self.enable_prefix_caching:
            return []
        return self._request_hashes(request)[: max(0, request.num_tokens - 1) // self.block_size]

    def pool_candidates(self, request: Request) -> tuple[int, list[BlockHash]]:
        """(leading full blocks cached here, hashes of the full blocks after them) of the
        request's tokens but the last."""
        if not self.enable_prefix_caching:
            return 0, []
        local = len(self._lookup(request, request.num_tokens - 1).blocks)
        return local, self.chain(request)[local:]

    def import_blocks(self, request: Request, hashes: list[BlockHash]) -> list[int]:
        """Fresh blocks for KV loaded from elsewhere (the pool) that continues the request's
        cached prefix, registered under `hashes` and held (with that prefix) until `unpin`, so
        no allocation evicts them before the request is scheduled and finds them as a prefix
        hit. Takes fewer (maybe none) when free blocks are short; returns their ids in order.
        The caller writes their KV before the next step."""
        local = [b for b in self._lookup(request, request.num_tokens - 1).blocks if b is not None]
        return self._import(request.request_id, local, hashes)

    def import_window(
        self, request: Request, held: list[BlockHash], hashes: list[BlockHash]
    ) -> list[int]:
        """`import_blocks` for a sliding group (engine/pool_link.py): the cached blocks a hit
        needs before the loaded ones are those under `held` (the window's first blocks), not
        the group's own longest hit."""
        cached = [self.pool.get_cached_block(h) for h in held]
        return self._import(request.request_id, [b for b in cached if b is not None], hashes)

    def _import(self, rid: str, local: list[Block], hashes: list[BlockHash]) -> list[int]:
        if rid in self._pins or rid in self._blocks:
            raise ValueError(f"request {rid!r} already holds blocks")
        reclaimable = sum(1 for b in local if b.ref_cnt == 0)
        n = max(0, min(len(hashes), self.pool.num_free_blocks - reclaimable - 1))
        self.pool.touch(local)  # before taking new blocks, so eviction cannot pick them
        fresh = self.pool.get_new_blocks(n)
        for block, block_hash in zip(fresh, hashes, strict=False):
            self.pool.cache_block(block, block_hash)
        self._pins[rid] = [*local, *fresh]
        return [b.block_id for b in fresh]

    def unpin(self, request_id: str) -> None:
        """Drop `import_blocks`' hold (the request's own blocks now reference what it uses)."""
        blocks = self._pins.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def pinned(self) -> list[str]:
        return list(self._pins)
